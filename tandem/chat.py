"""`tandem chat`: a small interactive client for a running server. It keeps the
conversation and resends it whole each turn, as agent frameworks do, and
prints after each answer how much of the prompt the prefix cache served."""
from __future__ import annotations

import sys

import grpc

from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc


def chat_loop(address: str, system: str | None, temperature: float | None,
              max_new_tokens: int, stdin=sys.stdin, stdout=sys.stdout, stderr=sys.stderr) -> int:
    stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(address))
    messages = [pb.ChatMessage(role="system", content=system)] if system else []
    sampling = pb.SamplingParameters(temperature=temperature) if temperature is not None else None
    interactive = stdin.isatty()
    while True:
        if interactive:
            stderr.write("> ")
            stderr.flush()
        line = stdin.readline()
        if not line or line.strip() in ("/quit", "/exit"):
            return 0
        if not line.strip():
            continue
        messages.append(pb.ChatMessage(role="user", content=line.rstrip("\n")))
        request = pb.GenerateRequest(chat=pb.Chat(messages=messages), max_new_tokens=max_new_tokens,
                                     sampling=sampling)
        try:
            answer = _stream_answer(stub, request, stdout, stderr)
        except grpc.RpcError as e:
            stderr.write(f"tandem chat: {e.code().name}: {e.details()}\n")
            messages.pop()
            if e.code() == grpc.StatusCode.UNAVAILABLE and not interactive:
                return 1
            continue
        messages.append(pb.ChatMessage(role="assistant", content=answer))


def _stream_answer(stub, request, stdout, stderr) -> str:
    answer = []
    for response in stub.Generate(request):
        if response.HasField("chunk"):
            answer.append(response.chunk.text)
            stdout.write(response.chunk.text)
            stdout.flush()
        else:
            usage = response.complete.usage
            stdout.write("\n")
            stderr.write(f"[{usage.completion_tokens} tokens; {usage.cached_tokens} of "
                         f"{usage.prompt_tokens} prompt tokens from the cache]\n")
    return "".join(answer)
