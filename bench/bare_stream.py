"""The floor under any gRPC token stream around vLLM: the smallest such service.

`make bench` starts this beside the tracewire server, on the same engine settings,
and measures it as one more interleaved row. It is vLLM's AsyncLLM and a grpc.aio
server with one method that streams, per generated token, one TraceResponse
holding one StepResult (step, token id, vLLM's own text delta, engine time): the
per-token messages a Trace with no interventions sends, with no tracewire code
in between. Its ratio to raw vLLM is what one gRPC message per token costs on the
machine; the trace rows' ratio to it is what tracewire itself adds.

    python bench/bare_stream.py PORT MODEL ENGINE_JSON NEW_TOKENS
"""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_overhead import async_llm  # noqa: E402

SERVICE, NAME = "tracewire.bench.Bare", "Stream"
METHOD = f"/{SERVICE}/{NAME}"  # request: the prompt's index, as ASCII digits


async def serve(port: int, model: str, engine: dict[str, object], new_tokens: int) -> None:
    from tracewire.v1 import service_pb2
    from vllm.sampling_params import RequestOutputKind

    llm, params, ids = async_llm(model, engine, new_tokens, output_kind=RequestOutputKind.DELTA)
    served = 0

    async def stream(request: bytes, context: grpc.aio.ServicerContext):
        nonlocal served
        served += 1
        prompt = {"prompt_token_ids": ids[int(request) % len(ids)]}
        step = 0
        async for out in llm.generate(prompt, params, f"bare-{served}"):
            now_ns = time.time_ns()
            c = out.outputs[0]
            response = service_pb2.TraceResponse()
            for k, token in enumerate(c.token_ids):
                result = response.steps.results.add(step=step, token_id=token,
                                                    text_delta=c.text if k == 0 else "")
                result.engine_time.seconds, result.engine_time.nanos = divmod(now_ns, 1_000_000_000)
                step += 1
            yield response.SerializeToString()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {NAME: grpc.unary_stream_rpc_method_handler(stream)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # the bench's terminate(): shut the engine down too
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    gc.collect()  # as the tracewire server does once it serves (server.py: _freeze_startup_heap)
    gc.freeze()
    print("bare stream: serving", flush=True)
    try:
        await stop.wait()
        await server.stop(1)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    port, model, engine, new_tokens = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    asyncio.run(serve(port, model, engine, new_tokens))
