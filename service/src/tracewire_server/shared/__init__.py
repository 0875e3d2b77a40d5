"""What the frontend and the worker share: the wire between them and the semantics both
sides must agree on.

``plan`` (the compiled plan, frontend -> worker), ``sidechannel`` (step records, worker ->
frontend), ``tensors`` (raw tensors as they travel), ``steering`` (steering tables),
``textmatch`` / ``detokenize`` (the text conditions see), ``limits`` (model limits).
"""
