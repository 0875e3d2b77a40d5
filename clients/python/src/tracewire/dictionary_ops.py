"""Dictionary reads and writes in traces as the wire carries them (ReadDictionary, WriteDictionary).

A dictionary is a linear probe or a sparse autoencoder the server holds by name
(`--dictionaries DIR` or an upload), on the output of one module. The trace API reaches
it from that module's reference (tracing.py's ModuleRef):

    out = inv.model.layers[3].output
    out.probe("refusal").save()                  # [k] probe outputs per step
    out.features("res-l3", top_k=20).save()      # a TopK of feature activations and ids
    out.steer_feature("res-l3", 1234, alpha=4)   # add 4 * W_dec[1234]

This module builds and checks the messages (the arguments a client can get wrong
without asking the server: names, feature lists, finite numbers); which dictionary,
module and feature range are valid is the server's to say (INVALID_ARGUMENT naming
the field). The registry side (the Dictionary type, what register_dictionary uploads) is
dictionaries.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, TypeGuard

import numpy as np

from .errors import InvalidArgument
from .v1 import intervention_pb2 as ipb

#: What a read returns per position: every value, the top k with ids, chosen ids, or
#: (SAEs) the reconstruction error's norm.
Selection = Literal["all", "top_k", "ids", "error"]


def check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{what}: a dictionary name (a non-empty str), got {name!r}")
    return name


def feature_ids(features: int | Sequence[int], what: str) -> list[int]:
    """One feature id or a list of them: ints, not empty, no duplicates."""
    listed: object = [features] if _is_int(features) else features
    if isinstance(listed, (str, bytes)) or not isinstance(listed, Sequence):
        raise InvalidArgument(f"{what}: a feature id (int) or a list of them, got {features!r}")
    ids: list[int] = []
    for f in listed:
        if not _is_int(f):
            raise InvalidArgument(f"{what}: feature ids are ints, got {f!r}")
        ids.append(int(f))
    if not ids:
        raise InvalidArgument(f"{what}: give at least one feature id")
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"{what}: duplicate feature ids in {ids}")
    return ids


def finite(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgument(f"{what}: a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidArgument(f"{what}: must be finite, got {number}")
    return number


def _is_int(value: object) -> TypeGuard[int | np.integer[Any]]:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def read_dictionary(
    name: str,
    module: str,
    positions: ipb.Positions,
    *,
    top_k: int | None = None,
    ids: int | Sequence[int] | None = None,
    error: bool = False,
) -> ipb.ReadDictionary:
    """ReadDictionary on `module` at `positions`; at most one of top_k / ids / error."""
    what = f"dictionary {name!r}"
    check_name(name, "dictionary")
    if sum((top_k is not None, ids is not None, error)) > 1:
        raise InvalidArgument(f"{what}: give top_k or ids, not both")
    message = ipb.ReadDictionary(dictionary=name, module=module, positions=positions)
    if top_k is not None:
        if not _is_int(top_k) or top_k < 1:
            raise InvalidArgument(f"{what}: top_k must be an int >= 1, got {top_k!r}")
        message.top_k.k = int(top_k)
    elif ids is not None:
        message.features.ids.extend(feature_ids(ids, f"{what}: ids"))
    elif error:
        message.reconstruction_error.SetInParent()
    return message


def selection(message: ipb.ReadDictionary) -> Selection:
    kinds: dict[str | None, Selection] = {None: "all", "top_k": "top_k", "features": "ids",
                                          "reconstruction_error": "error"}
    return kinds[message.WhichOneof("selection")]


def steer(name: str, module: str, positions: ipb.Positions, features: int | Sequence[int],
          alpha: float) -> ipb.WriteDictionary:
    """Add alpha * direction for each feature (SAE: W_dec[f]; probe: W[f], unnormalised)."""
    check_name(name, "dictionary")
    return ipb.WriteDictionary(
        dictionary=name, module=module, positions=positions,
        features=feature_ids(features, f"dictionary {name!r}: features"),
        steer=finite(alpha, f"dictionary {name!r}: alpha"),
    )


def clamp(name: str, module: str, positions: ipb.Positions, features: int | Sequence[int],
          value: float) -> ipb.WriteDictionary:
    """Set each feature's activation to `value`, keeping the reconstruction error (SAEs)."""
    check_name(name, "dictionary")
    return ipb.WriteDictionary(
        dictionary=name, module=module, positions=positions,
        features=feature_ids(features, f"dictionary {name!r}: features"),
        clamp=finite(value, f"dictionary {name!r}: value"),
    )


def ablate(name: str, module: str, positions: ipb.Positions, features: int | Sequence[int]) -> ipb.WriteDictionary:
    """Clamp each feature to 0 (SAEs)."""
    check_name(name, "dictionary")
    return ipb.WriteDictionary(
        dictionary=name, module=module, positions=positions,
        features=feature_ids(features, f"dictionary {name!r}: features"),
        ablate=ipb.FeatureAblation(),
    )


__all__ = ["Selection", "ablate", "check_name", "clamp", "feature_ids", "finite", "read_dictionary", "selection",
           "steer"]
