"""The frontend process: what runs in the server's own process(es).

gRPC and HTTP edges (servicer, server, http_gateway, calls, auth, tenants, tls, ...),
the plan compiler (compiler, bounds, sampling, prompts), the engine adapter (engine,
vllm_compat, engine_group) and the per-trace stream (trace, outbox, outputs).
Nothing here runs inside vLLM's worker; what the worker needs lives in ``shared``.
"""
