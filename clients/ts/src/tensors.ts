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

const ITEM_SIZE: Record<Dtype, number> = {
  [Dtype.UNSPECIFIED]: 0,
  [Dtype.FLOAT32]: 4,
  [Dtype.FLOAT16]: 2,
  [Dtype.BFLOAT16]: 2,
  [Dtype.FLOAT64]: 8,
  [Dtype.INT32]: 4,
  [Dtype.INT64]: 8,
  [Dtype.BOOL]: 1,
};

// Typed arrays use the host's byte order; the wire is little-endian.
const LITTLE_ENDIAN_HOST = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

/** Decode a Tensor; throws TracewireError(DATA_LOSS) when its bytes do not match its shape. */
export function decodeTensor(tensor: Tensor): DecodedTensor {
  const shape = tensor.shape.map(Number);
  const count = shape.reduce((a, b) => a * b, 1);
  const itemSize = ITEM_SIZE[tensor.dtype];
  if (!itemSize) {
    throw new TracewireError(`tensor has unknown dtype ${tensor.dtype}`, Code.DataLoss);
  }
  if (tensor.data.byteLength !== count * itemSize) {
    throw new TracewireError(
      `tensor of shape [${shape.join(", ")}] and dtype ${Dtype[tensor.dtype]} has ` +
        `${tensor.data.byteLength} bytes, expected ${count * itemSize}`,
      Code.DataLoss,
    );
  }
  const bytes = littleEndianCopy(tensor.data, itemSize);
  return { dtype: tensor.dtype, shape, data: toArray(tensor.dtype, bytes.buffer) };
}

/** A FLOAT32 Tensor (the dtype writes take) from numbers; shape defaults to 1-D. */
export function float32Tensor(values: ArrayLike<number>, shape: readonly number[] = [values.length]): Tensor {
  const count = shape.reduce((a, b) => a * b, 1);
  if (count !== values.length) {
    throw new TracewireError(`${values.length} values do not fill shape [${shape.join(", ")}]`, Code.InvalidArgument);
  }
  const data = new Uint8Array(values.length * 4);
  const view = new DataView(data.buffer);
  for (let i = 0; i < values.length; i++) {
    view.setFloat32(i * 4, values[i] as number, true);
  }
  return create(TensorSchema, { dtype: Dtype.FLOAT32, shape: shape.map(BigInt), data });
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

function toArray(dtype: Dtype, buffer: ArrayBufferLike): TensorArray {
  switch (dtype) {
    case Dtype.FLOAT32:
      return new Float32Array(buffer);
    case Dtype.FLOAT64:
      return new Float64Array(buffer);
    case Dtype.INT32:
      return new Int32Array(buffer);
    case Dtype.INT64:
      return new BigInt64Array(buffer);
    case Dtype.BOOL:
      return new Uint8Array(buffer);
    case Dtype.BFLOAT16:
      return widenBfloat16(new Uint16Array(buffer));
    case Dtype.FLOAT16:
      return widenFloat16(new Uint16Array(buffer));
    default:
      throw new TracewireError(`tensor has unknown dtype ${dtype}`, Code.DataLoss);
  }
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
