/** Tensor decoding against hand-made little-endian bytes (no server needed). */

import assert from "node:assert/strict";
import { test } from "node:test";
import { create } from "@bufbuild/protobuf";
import { Code, Dtype, TracewireError, decodeTensor, float32Tensor, statusName } from "../src/index.js";
import { TensorSchema } from "../src/gen/tracewire/v1/tensor_pb.js";

function tensor(dtype: Dtype, shape: number[], bytes: number[], offset = 0) {
  // A slice at an odd offset, as protobuf hands out bytes inside a larger message buffer.
  const backing = new Uint8Array(offset + bytes.length);
  backing.set(bytes, offset);
  return create(TensorSchema, { dtype, shape: shape.map(BigInt), data: backing.subarray(offset) });
}

test("float32: little-endian bytes at an unaligned offset", () => {
  const bytes = new Uint8Array(new Float32Array([1.5, -2.25, 3e-8, Infinity]).buffer); // this host is little-endian
  const decoded = decodeTensor(tensor(Dtype.FLOAT32, [2, 2], [...bytes], 3));
  assert.ok(decoded.data instanceof Float32Array);
  assert.deepEqual(decoded.shape, [2, 2]);
  assert.deepEqual([...decoded.data], [1.5, -2.25, Math.fround(3e-8), Infinity]);
});

test("int64 decodes to BigInt64Array, int32 to Int32Array", () => {
  const i64 = decodeTensor(tensor(Dtype.INT64, [], [0x26, 0x03, 0, 0, 0, 0, 0, 0], 1)); // 806, a scalar
  assert.ok(i64.data instanceof BigInt64Array);
  assert.deepEqual(i64.shape, []);
  assert.equal(i64.data[0], 806n);
  const i32 = decodeTensor(tensor(Dtype.INT32, [2], [0xff, 0xff, 0xff, 0xff, 0x1a, 0x03, 0, 0]));
  assert.ok(i32.data instanceof Int32Array);
  assert.deepEqual([...i32.data], [-1, 794]);
});

test("bfloat16 and float16 widen to Float32Array", () => {
  // bf16: 1.0 = 0x3f80, -2.5 = 0xc020; f16: 1.0 = 0x3c00, -2.5 = 0xc100, 2^-24 (subnormal) = 0x0001
  const bf = decodeTensor(tensor(Dtype.BFLOAT16, [2], [0x80, 0x3f, 0x20, 0xc0], 1));
  assert.ok(bf.data instanceof Float32Array);
  assert.deepEqual([...bf.data], [1, -2.5]);
  const f16 = decodeTensor(tensor(Dtype.FLOAT16, [4], [0x00, 0x3c, 0x00, 0xc1, 0x01, 0x00, 0x00, 0x7c]));
  assert.ok(f16.data instanceof Float32Array);
  assert.deepEqual([...f16.data], [1, -2.5, 2 ** -24, Infinity]);
});

test("a tensor whose bytes do not fill its shape is DATA_LOSS", () => {
  assert.throws(
    () => decodeTensor(tensor(Dtype.FLOAT32, [3], [0, 0, 0, 0])),
    (e: unknown) => e instanceof TracewireError && e.code === Code.DataLoss && /expected 12/.test(e.message),
  );
});

test("float32Tensor round-trips through decodeTensor", () => {
  const t = float32Tensor([0.5, -1, 2], [3]);
  assert.equal(t.dtype, Dtype.FLOAT32);
  assert.deepEqual([...decodeTensor(t).data], [0.5, -1, 2]);
  assert.throws(() => float32Tensor([1, 2, 3], [2, 2]), TracewireError);
});

test("status names are gRPC's", () => {
  assert.equal(statusName(Code.InvalidArgument), "INVALID_ARGUMENT");
  assert.equal(statusName(Code.ResourceExhausted), "RESOURCE_EXHAUSTED");
  assert.equal(statusName(Code.Canceled), "CANCELLED");
});
