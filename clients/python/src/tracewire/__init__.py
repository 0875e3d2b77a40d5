"""tracewire: observe and steer vLLM generation over gRPC.

    import tracewire
    client = tracewire.Client("localhost:50051")
    out = client.generate("The capital of France is", temperature=0.0, max_tokens=8)
    print(out[0].outputs[0].text)
"""

# tracewire.v1, the code generated from the contract, is another distribution's:
# tracewire-contract ships tracewire/v1/ and nothing else. Installed from wheels, both land in
# one site-packages/tracewire/; installed editable or run from a checkout (PYTHONPATH), they
# are two directories, and this makes tracewire's subpackages found in each of them.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

from .aio import AsyncClient, AsyncTracer
from .client import Client
from .conditions import (
    Condition,
    argmax_in,
    dictionary_value,
    entropy,
    feature_active,
    prob,
    probe_above,
    probe_below,
    sampled_in,
    text_contains,
    text_matches,
)
from .dictionaries import Dictionary
from .errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TracewireError,
    Unavailable,
    Unimplemented,
    Unreachable,
)
from .mapping import Item, MapResults
from .outputs import CompletionOutput, Logprob, RequestOutput
from .rpcs import EngineStats, ModelInfo, ModuleInfo, StreamUpdate
from .sampling import SAMPLING_KEYWORDS
from .tls import Tls
from .tokenizer import RemoteTokenizer
from .tracing import AttentionPattern, Invoke, Logprobs, ModuleRef, Saved, Step, StepView, TopK, Tracer, TraceWarning

__version__ = "0.1.0"

__all__ = [
    "SAMPLING_KEYWORDS",
    "AsyncClient",
    "AttentionPattern",
    "AsyncTracer",
    "Condition",
    "Invoke",
    "Item",
    "MapResults",
    "Logprobs",
    "ModuleRef",
    "Saved",
    "Step",
    "StepView",
    "Tls",
    "TopK",
    "TraceWarning",
    "Tracer",
    "argmax_in",
    "dictionary_value",
    "entropy",
    "feature_active",
    "prob",
    "probe_above",
    "probe_below",
    "sampled_in",
    "text_contains",
    "text_matches",
    "Cancelled",
    "Client",
    "CompletionOutput",
    "DeadlineExceeded",
    "Dictionary",
    "AlreadyExists",
    "PermissionDenied",
    "EngineStats",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "Logprob",
    "ModelInfo",
    "ModuleInfo",
    "NotFound",
    "RemoteTokenizer",
    "RequestOutput",
    "ResourceExhausted",
    "StreamUpdate",
    "TracewireError",
    "Unavailable",
    "Unimplemented",
    "Unreachable",
]
