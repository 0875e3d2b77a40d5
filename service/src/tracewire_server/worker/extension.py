"""The worker extension: what vLLM mixes into its worker class (`worker_extension_cls`).

The frontend names `TracewireWorkerExtension` in the engine's config (frontend/engine.py)
and calls its `tracewire_*` methods on every worker through collective_rpc (install the
hooks, say which graph hooks the model took, release a trace's patches, dictionaries).
Separate from the hooks because every method of the extension class becomes an RPC vLLM
offers: this class holds only those, and `install` is a plain function.
"""

from __future__ import annotations

import logging
from typing import Any

from ..shared import steering
from ..shared.dictionary_spec import decode_info, encode_info
from .cpu_generators import keep_cpu_generators
from .hooks import PlanHooks
from .runner import RunnerView, check_supported
from .sender import Sender, unreachable
from .stage_steps import StageSteps

# Under vLLM's logger: vLLM configures its handlers (with the process prefix) in the
# worker processes; a logger of our own would have none there.
log = logging.getLogger(f"vllm.{__name__}")


class TracewireWorkerExtension:
    """Mixed into vLLM's worker class (worker_extension_cls)."""

    def tracewire_install(self, address: str, fault_injection: bool = False, route: int = 0) -> int:
        """Wrap the sampler (once) and connect frontend `route`'s side channel. Every
        frontend process sharing this engine calls this with its own address and route."""
        rank = getattr(self, "rank", 0)
        hooks: PlanHooks | None = getattr(self, "tracewire_hooks", None)
        if hooks is None:
            runner = self.model_runner  # type: ignore[attr-defined]
            hooks = self.tracewire_hooks = install(runner, fault_injection)
        if hooks.runner.sends:
            if (problem := unreachable(address, rank)) is not None:
                raise RuntimeError(problem)
            previous = hooks.senders.get(route)
            hooks.senders[route] = Sender(address)
            if previous is not None:  # the frontend asked again (engine.py)
                previous.close()
            log.info("tracewire hooks installed; records of frontend %d go to %s", route, address)
        return int(rank)

    def tracewire_graph_hooks(self) -> dict[str, list[Any]]:
        """The layers this worker's compiled graph has each kind of hook on (steering.py's
        config keys -> layers): what the frontend serves compiled, from the one place
        that knows (a defaulted kind the model could not take is not there)."""
        return steering.attached(self.model_runner.get_model())  # type: ignore[attr-defined]

    def tracewire_release(self, trace: str) -> tuple[int, int, int, int]:
        """Forget trace `trace`'s patch sources' values (the frontend calls this when the
        trace ends, however it ends): (bytes freed, then what the store still holds:
        traces, entries, bytes)."""
        hooks: PlanHooks | None = getattr(self, "tracewire_hooks", None)
        if hooks is None:
            return 0, 0, 0, 0
        freed = hooks.patches.release(trace)
        held = hooks.patches.size()
        log.debug("patch store: released %s (%d bytes); holds %d traces, %d bytes", trace, freed,
                  held.traces, held.bytes)
        return freed, held.traces, held.entries, held.bytes

    # -- dictionaries (probes, SAEs): the frontend's registry asks every worker --------

    def tracewire_dictionary_load(self, info: bytes, path: str) -> bool:
        """Start loading the safetensors file at `path` as dictionary `info` (replacing one
        of that name), off the engine's thread; tracewire_dictionary_loaded answers."""
        self._hooks().loads.start(decode_info(info), path)
        return True

    def tracewire_dictionary_loaded(self, name: str, generation: int) -> tuple[bool, bytes, str, str]:
        """(done, then the completed info or the bad file's field and message)."""
        result = self._hooks().loads.result(name, generation)
        if result is None:
            return False, b"", "", ""
        if result.info:
            log.info("dictionary %s (generation %d) loaded", name, generation)
        return True, result.info, result.field, result.message

    def tracewire_dictionary_delete(self, name: str) -> int:
        """Forget dictionary `name`: the device bytes freed (0: none held)."""
        return self._hooks().dictionaries.delete(name)

    def tracewire_dictionaries(self) -> list[bytes]:
        """Every dictionary held (encode_info)."""
        return [encode_info(info) for info in self._hooks().dictionaries.infos()]

    def _hooks(self) -> PlanHooks:
        hooks: PlanHooks | None = getattr(self, "tracewire_hooks", None)
        if hooks is None:
            raise RuntimeError("tracewire hooks are not installed on this worker")
        return hooks


def install(runner: Any, fault_injection: bool) -> PlanHooks:
    """Wrap vLLM model runner `runner`'s sampler (and, eager, its modules; compiled with
    steering tables or read buffers, its forward pass's host side): on the last pipeline
    stage only (an earlier stage's eager module hooks send their own reads)."""
    check_supported(runner)
    keep_cpu_generators(runner)  # (a seeded request mid-prefill would kill a CPU engine)
    view = RunnerView(runner)
    view.prepare_pipeline_stage()
    hooks = PlanHooks(view, fault_injection)  # (on every stage: dictionaries load everywhere)
    if not view.samples:
        # An earlier pipeline stage: no sampler runs here. Eager, its module hooks run on
        # its layers and StageSteps counts the steps and sends their reads.
        if view.eager:
            hooks.install_module_hooks()
            StageSteps(view, hooks.sequences, hooks.senders, hooks.patches, hooks.dictionaries).install()
        return hooks
    hooks.install(view.sampler)
    if view.eager:  # hooks cannot fire inside compiled graphs
        hooks.install_module_hooks()
        return hooks
    tables = [t for t in (view.steering_tables(), view.unit_steering_tables(), view.module_steering_tables())
              if t is not None]
    if tables:
        hooks.install_compiled_steering(tables)
    if (buffers := view.read_buffers()) is not None:
        hooks.install_compiled_reads(buffers)
    return hooks
