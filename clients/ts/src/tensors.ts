/**
 * tracewire.v1.Tensor <-> typed arrays.
 *
 * On the wire a Tensor is a dtype, a shape and raw little-endian, row-major bytes
 * (proto/tracewire/v1/tensor.proto). Decoding copies the bytes into a fresh, aligned
 * buffer (protobuf's bytes are often an unaligned slice of the message); 16-bit
 * floats are widened to Float32Array, as the Python SDK widens them to float32.
 */

import { create } from "@bufbuild/protobuf";
import { Code, TracewireError } from "./errors.js";
import { Dtype, TensorSchema, type Tensor } from "./gen/tracewire/v1/tensor_pb.js";

export { Dtype };

/** The array a dtype decodes to. */
export interface DtypeArrays {
  [Dtype.FLOAT32]: Float32Array;
  [Dtype.FLOAT16]: Float32Array;
  [Dtype.BFLOAT16]: Float32Array;
  [Dtype.FLOAT64]: Float64Array;
  [Dtype.INT32]: Int32Array;
  [Dtype.INT64]: BigInt64Array;
  [Dtype.BOOL]: Uint8Array;
}

export type TensorArray = DtypeArrays[keyof DtypeArrays];

/** A decoded tensor: row-major `data` with `shape` (empty for a scalar). */
export interface DecodedTensor<A extends TensorArray = TensorArray> {
  /** The wire dtype (FLOAT16 / BFLOAT16 data is already widened to float32). */
  readonly dtype: Dtype;
  readonly shape: readonly number[];
  readonly data: A;
}

/** A wire dtype: the name the server gives it, its bytes per element, and its decoding. */
export interface DtypeInfo<A extends TensorArray = TensorArray> {
  readonly name: string;
  readonly itemSize: number;
  /** The elements of an aligned, host-order buffer of them. */
  readonly decode: (buffer: ArrayBufferLike) => A;
}

/**
 * Every wire dtype: the client's one table of them (tests/test_dtype_parity.py holds it to
 * the server's and the Python SDK's).
 */
export const DTYPES: { readonly [D in keyof DtypeArrays]: DtypeInfo<DtypeArrays[D]> } = {
  [Dtype.FLOAT32]: { name: "float32", itemSize: 4, decode: (buffer) => new Float32Array(buffer) },
  [Dtype.FLOAT16]: { name: "float16", itemSize: 2, decode: (buffer) => widenFloat16(new Uint16Array(buffer)) },
  [Dtype.BFLOAT16]: { name: "bfloat16", itemSize: 2, decode: (buffer) => widenBfloat16(new Uint16Array(buffer)) },
  [Dtype.FLOAT64]: { name: "float64", itemSize: 8, decode: (buffer) => new Float64Array(buffer) },
  [Dtype.INT32]: { name: "int32", itemSize: 4, decode: (buffer) => new Int32Array(buffer) },
  [Dtype.INT64]: { name: "int64", itemSize: 8, decode: (buffer) => new BigInt64Array(buffer) },
  [Dtype.BOOL]: { name: "bool", itemSize: 1, decode: (buffer) => new Uint8Array(buffer) },
};

/** The dtype the client sends tensors in (writes' vectors and rows; the server computes them in float32). */
export const DEFAULT_DTYPE = Dtype.FLOAT32;

// Typed arrays use the host's byte order; the wire is little-endian.
const LITTLE_ENDIAN_HOST = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

/** Decode a Tensor; throws TracewireError(DATA_LOSS) when its bytes do not match its shape. */
export function decodeTensor(tensor: Tensor): DecodedTensor {
  const shape = tensor.shape.map(Number);
  const count = shape.reduce((a, b) => a * b, 1);
  const info = dtypeInfo(tensor.dtype);
  if (!info) {
    throw new TracewireError(`tensor has unknown dtype ${tensor.dtype}`, Code.DataLoss);
  }
  const itemSize = info.itemSize;
  if (tensor.data.byteLength !== count * itemSize) {
    throw new TracewireError(
      `tensor of shape [${shape.join(", ")}] and dtype ${Dtype[tensor.dtype]} has ` +
        `${tensor.data.byteLength} bytes, expected ${count * itemSize}`,
      Code.DataLoss,
    );
  }
  const bytes = littleEndianCopy(tensor.data, itemSize);
  return { dtype: tensor.dtype, shape, data: info.decode(bytes.buffer) };
}

/** The table's entry for a dtype; undefined for UNSPECIFIED and values it does not know. */
function dtypeInfo(dtype: Dtype): DtypeInfo | undefined {
  return (DTYPES as Partial<Record<Dtype, DtypeInfo>>)[dtype];
}

/** A FLOAT32 (DEFAULT_DTYPE) Tensor from numbers; shape defaults to 1-D. */
export function float32Tensor(values: ArrayLike<number>, shape: readonly number[] = [values.length]): Tensor {
  const count = shape.reduce((a, b) => a * b, 1);
  if (count !== values.length) {
    throw new TracewireError(`${values.length} values do not fill shape [${shape.join(", ")}]`, Code.InvalidArgument);
  }
  const itemSize = DTYPES[DEFAULT_DTYPE].itemSize;
  const data = new Uint8Array(values.length * itemSize);
  const view = new DataView(data.buffer);
  for (let i = 0; i < values.length; i++) {
    view.setFloat32(i * itemSize, values[i] as number, true);
  }
  return create(TensorSchema, { dtype: DEFAULT_DTYPE, shape: shape.map(BigInt), data });
}

/** A copy of the bytes in an aligned buffer of its own, in the host's byte order. */
function littleEndianCopy(data: Uint8Array, itemSize: number): Uint8Array {
  const copy = data.slice();
  if (!LITTLE_ENDIAN_HOST && itemSize > 1) {
    for (let i = 0; i < copy.length; i += itemSize) {
      copy.subarray(i, i + itemSize).reverse();
    }
  }
  return copy;
}

/** bfloat16 is the top half of a float32: shift the pattern back into place. */
function widenBfloat16(halves: Uint16Array): Float32Array {
  const bits = new Uint32Array(halves.length);
  for (let i = 0; i < halves.length; i++) {
    bits[i] = (halves[i] as number) << 16;
  }
  return new Float32Array(bits.buffer);
}

/** IEEE 754 half precision -> float32 (Node 20 has no Float16Array). */
function widenFloat16(halves: Uint16Array): Float32Array {
  const out = new Float32Array(halves.length);
  for (let i = 0; i < halves.length; i++) {
    out[i] = halfToNumber(halves[i] as number);
  }
  return out;
}

function halfToNumber(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exponent = (h >> 10) & 0x1f;
  const fraction = h & 0x3ff;
  if (exponent === 0) {
    return sign * 2 ** -14 * (fraction / 1024); // subnormal (and zero)
  }
  if (exponent === 0x1f) {
    return fraction ? NaN : sign * Infinity;
  }
  return sign * 2 ** (exponent - 15) * (1 + fraction / 1024);
}
