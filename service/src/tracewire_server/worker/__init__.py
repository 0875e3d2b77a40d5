"""Code that runs inside vLLM's worker process, loaded as its worker extension.

It imports only from ``shared`` (the plan it executes, the records it sends back) and
vLLM: never from ``frontend``.
"""
