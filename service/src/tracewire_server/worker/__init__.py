"""Code that runs inside vLLM's worker process, loaded as its worker extension.

It imports only from ``shared`` (the plan it executes, the records it sends back) and
vLLM: never from ``frontend``. ``extension`` is what vLLM loads; ``hooks`` runs the
plans step by step; ``runner`` is the only module that touches vLLM's runner.
"""
