"""tracewire: observe and steer vLLM generation over gRPC.

    import tracewire
    client = tracewire.Client("localhost:50051")
    out = client.generate("The capital of France is", temperature=0.0, max_tokens=8)
    print(out[0].outputs[0].text)
"""

from .client import Client, ModelInfo, ModuleInfo, StreamUpdate
from .errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TracewireError,
    Unavailable,
    Unimplemented,
)
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling import SAMPLING_KEYWORDS
from .tokenizer import RemoteTokenizer

__version__ = "0.1.0"

__all__ = [
    "SAMPLING_KEYWORDS",
    "Cancelled",
    "Client",
    "CompletionOutput",
    "DeadlineExceeded",
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
]
