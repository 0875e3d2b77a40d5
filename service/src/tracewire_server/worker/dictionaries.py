"""Dictionaries on the engine's device: linear probes and SAEs, their values and directions.

A dictionary's weights are loaded once (the frontend asks every worker through
collective_rpc: extension.py) and kept on the device in their file's dtype. Reads
apply it to module rows the hooks gathered (dictionary_reads.py: one matmul per dictionary,
selection and step for every new-token row using it, a bounded chunk of rows at a time);
writes add its directions or clamp its features in the forward pass (module_hooks.py). The
arithmetic is dictionary.proto's, in one place.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from ..shared import plan as P
from ..shared.dictionary_spec import DictionaryError, DictionaryInfo, check_tensors, encode_info
from ..shared.steering import ClampRows
from .host import on_device
from .runner import RunnerView

# Dictionary arithmetic over many rows at once (a long prompt's positions) goes a chunk of
# rows at a time, each holding at most about this many bytes of device memory: a 32k-token
# prompt through a 131k-feature SAE would otherwise hold [32k, 131k] float32 (17 GB).
CHUNK_BYTES = 512 << 20

_TORCH_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class Dictionary:
    """One dictionary's weights on the device, and what reads and writes compute from them."""

    def __init__(self, info: DictionaryInfo, tensors: dict[str, torch.Tensor]) -> None:
        self.info = info
        self.tensors = tensors
        hidden, size = info.input_size, info.size
        like = next(iter(tensors.values()))
        zeros = lambda n: torch.zeros(n, dtype=like.dtype, device=like.device)  # noqa: E731
        if info.kind == "probe":
            self.directions = tensors["W"]  # [k, hidden]: a probe's rows are its directions
            self.bias = tensors.get("b", zeros(size))
        else:
            self.encoder = tensors["W_enc"]  # [hidden, d]
            self.encoder_bias = tensors.get("b_enc", zeros(size))
            self.directions = tensors["W_dec"]  # [d, hidden]
            self.decoder_bias = tensors.get("b_dec", zeros(hidden))
            self.threshold = tensors.get("threshold")

    @property
    def dtype(self) -> torch.dtype:
        return self.directions.dtype

    @property
    def chunk_rows(self) -> int:
        """Rows per chunk of CHUNK_BYTES: values() holds ~3 [rows, size] float32 tensors
        (pre-activations, activations, an SAE's top-k scratch), and a row of the input."""
        return max(1, CHUNK_BYTES // (12 * self.info.size + 8 * self.info.input_size))

    def chunks(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[rows, hidden] rows as chunks of at most chunk_rows rows (views)."""
        n = self.chunk_rows
        return [x] if x.shape[0] <= n else list(x.split(n))

    @torch.no_grad()
    def values(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] module rows -> [rows, size] float32: probe outputs after their
        activation, or SAE feature activations."""
        x = x.to(self.dtype)
        info = self.info
        if info.kind == "probe":
            z = (x @ self.directions.t() + self.bias).float()
            if info.probe_activation == "sigmoid":
                return torch.sigmoid(z)
            if info.probe_activation == "softmax":
                return torch.softmax(z, dim=-1)
            return z
        if info.subtract_decoder_bias:
            x = x - self.decoder_bias
        z = (x @ self.encoder + self.encoder_bias).float()
        if info.sae_activation == "jumprelu":
            assert self.threshold is not None
            return torch.where(z > self.threshold.float(), z, torch.zeros_like(z))
        if info.sae_activation == "topk":
            top = torch.topk(z, info.sae_top_k, dim=-1, sorted=False)
            return torch.zeros_like(z).scatter_(-1, top.indices, torch.relu(top.values))
        return torch.relu(z)

    @torch.no_grad()
    def reconstruction_error(self, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """||x - (features @ W_dec + b_dec)|| per row: [rows, 1] float32 (SAEs)."""
        reconstruction = features.to(self.dtype) @ self.directions + self.decoder_bias
        return torch.linalg.vector_norm(x.float() - reconstruction.float(), dim=-1, keepdim=True)

    def direction(self, features: tuple[int, ...], scale: float) -> torch.Tensor:
        """scale * the sum of the features' directions: [hidden], in the weights' dtype."""
        index = on_device(list(features), self.directions.device, torch.long)
        return (self.directions.index_select(0, index).float().sum(0) * scale).to(self.dtype)

    @torch.no_grad()
    def clamp_rows(self, clamp: P.DictionaryEdit, device: torch.device) -> ClampRows:
        """What a compiled table's columns need to clamp these features (steering.py): the
        pre-activation of feature f is x @ W_enc[:, f] + b_enc[f] - (b_dec @ W_enc[:, f] where
        the SAE subtracts its decoder bias), active above its threshold (0: ReLU). Top-k SAEs'
        activations depend on every feature: the frontend refuses them there."""
        if self.info.kind != "sae" or self.info.sae_activation == "topk":
            raise RuntimeError(f"{self.info.name!r}'s clamps are not computed in compiled graphs")
        index = on_device(list(clamp.features), self.directions.device, torch.long)
        encoders = self.encoder.index_select(1, index).t().float()  # [features, hidden]
        biases = self.encoder_bias.index_select(0, index).float()
        if self.info.subtract_decoder_bias:
            biases = biases - self.decoder_bias.float() @ encoders.t()
        thresholds = (self.threshold.index_select(0, index).float() if self.info.sae_activation == "jumprelu"
                      else torch.zeros_like(biases))
        decoders = self.directions.index_select(0, index).float()
        ref = clamp.dictionary
        keys = tuple((ref.name, ref.generation, feature, float(clamp.value)) for feature in clamp.features)
        return ClampRows(*(t.to(device) for t in (encoders, biases, thresholds, decoders)), float(clamp.value), keys)

    @torch.no_grad()
    def clamp_delta(self, x: torch.Tensor, features: tuple[int, ...], value: float) -> torch.Tensor:
        """What to add to rows `x` ([rows, hidden]) so each feature's activation becomes
        `value`, the reconstruction error kept: sum_f (value - a_f(x)) * W_dec[f]."""
        index = on_device(list(features), self.directions.device, torch.long)  # (no wait for the device)
        directions = self.directions.index_select(0, index).float()
        deltas = [(value - self.values(chunk).index_select(1, index)) @ directions  # [rows, features] @
                  for chunk in self.chunks(x)]
        return deltas[0] if len(deltas) == 1 else torch.cat(deltas)


def load(info: DictionaryInfo, path: str, device: torch.device, hidden_size: int) -> Dictionary:
    """The safetensors file at `path` as dictionary `info` on `device`, checked: shapes
    against the model (check_tensors), every value finite. DictionaryError otherwise.
    Runs on a loader thread (Loads), never on the engine's."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            for name in names:
                tensors[name] = f.get_tensor(name)
    except Exception as e:  # noqa: BLE001 - a malformed file is the uploader's error
        raise DictionaryError("chunk", f"not a readable safetensors file: {e}") from None
    shapes = {name: (_TORCH_DTYPES.get(t.dtype, str(t.dtype).removeprefix("torch.")), tuple(t.shape))
              for name, t in tensors.items()}
    info = check_tensors(info, shapes, hidden_size)
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise DictionaryError(f"tensors.{name}", "contains NaN or infinite values")
    return Dictionary(info, _to_device(tensors, device))


def _to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Copies of `tensors` on `device`. On the loader thread: only it waits for the copy.
    On a GPU the copy queues behind the forward pass in flight and the engine's next
    kernels behind it (tens of ms for a 512 MB SAE, once), in the stream the forward passes
    use, so the memory's later release is ordered with the passes that read it."""
    return {name: t.to(device) for name, t in tensors.items()}


class LoadResult(NamedTuple):
    """A finished load: the completed info (encode_info), or the field and message of a bad
    file (info empty)."""

    info: bytes
    field: str
    message: str


class Loads:
    """Dictionary loads, each on a thread of its own: reading a file and copying it to the
    device take up to seconds for a large SAE, and on the engine's thread (collective_rpc
    runs there) they would stall every request for as long. The frontend starts a load,
    then polls for its result; the dictionary joins `dictionaries` when it is ready."""

    def __init__(self, dictionaries: Dictionaries, runner: RunnerView) -> None:
        self.dictionaries = dictionaries
        self.runner = runner  # (its device and hidden size, read when a load starts)
        self._done: dict[tuple[str, int], LoadResult] = {}
        self._lock = threading.Lock()

    def start(self, info: DictionaryInfo, path: str) -> None:
        where = (self.runner.device, self.runner.hidden_size)
        threading.Thread(target=self._load, args=(info, path, *where), name=f"tracewire-load-{info.name}",
                         daemon=True).start()

    def result(self, name: str, generation: int) -> LoadResult | None:
        """The load's result once it is finished (then forgotten), None while it runs."""
        with self._lock:
            return self._done.pop((name, generation), None)

    def _load(self, info: DictionaryInfo, path: str, device: torch.device, hidden_size: int) -> None:
        try:
            dictionary = load(info, path, device, hidden_size)
        except DictionaryError as e:
            result = LoadResult(b"", e.field, e.message)
        except Exception as e:  # noqa: BLE001 - a failed load is the caller's answer, not the worker's end
            result = LoadResult(b"", "file", f"{type(e).__name__}: {e}")
        else:
            self.dictionaries.put(dictionary)  # (one dict assignment: the engine thread reads it)
            result = LoadResult(encode_info(dictionary.info), "", "")
        with self._lock:
            self._done[(info.name, info.generation)] = result


class Dictionaries:
    """The dictionaries this worker holds, by name."""

    def __init__(self) -> None:
        self.by_name: dict[str, Dictionary] = {}

    def put(self, dictionary: Dictionary) -> None:
        self.by_name[dictionary.info.name] = dictionary  # (the old one's memory goes with it)

    def delete(self, name: str) -> int:
        found = self.by_name.pop(name, None)
        return found.info.device_bytes if found is not None else 0

    def infos(self) -> list[DictionaryInfo]:
        return [d.info for d in self.by_name.values()]

    def get(self, ref: P.DictRef) -> Dictionary:
        """The dictionary a plan names, as the plan was compiled against it."""
        found = self.by_name.get(ref.name)
        if found is None or found.info.generation != ref.generation:
            raise RuntimeError(f"dictionary {ref.name!r} was deleted or replaced after this trace was "
                               "compiled against it")
        return found

