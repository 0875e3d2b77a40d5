"""What the frontend and the worker share: the wire between them and the semantics both
sides must agree on.

``plan`` (the compiled plan, frontend -> worker), ``sidechannel`` (the step records' wire
format, worker -> frontend; the ends are worker/sender.py and frontend/receiver.py),
``tensors`` (raw tensors as they travel), ``steering`` (steering tables),
``textmatch`` / ``detokenize`` (the text conditions see), ``limits`` (model limits).
Nothing here imports from ``frontend`` or ``worker``.
"""
