"""tracewire server: a gRPC service that observes and steers vLLM generation."""

__version__ = "0.1.0"
