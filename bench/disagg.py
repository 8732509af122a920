"""`tandem bench disagg`: what moving KV between stores costs.

Starts `tandem serve` twice on the same model and flags: the shared topology
(one store) and the disaggregated one (1 prefill + 1 decode worker, each with
its own store, transfers by --kv-transfer), and sends the same prompts of
each length, greedy, a fresh cache salt per request (nothing cached). For each:

  ttft         client-side time to the first token (the prefill; in the
               disaggregated topology the first token is sent before the
               transfer's tail has arrived)
  tt2t         time to the second token (includes waiting for the transfer)
  transfer     bytes moved, and the router's wait after the prefill for the
               transfer's tail (pages travel layer by layer during the
               prefill, so the tail is what the last layers, the state and
               the snapshot take)

Link bandwidth itself is `--raw`: synthetic pages moved by peer copies and by
torch.distributed between two processes, against the device copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request

from bench.service import Service, add_service_arguments
from tandem.ports import free_port


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _copy_bandwidth(device: str, nbytes: int = 256 << 20) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - t0) / 1e9


def _run(svc: Service, metrics_port: int, lengths, repeats: int, new_tokens: int) -> list[dict]:
    from tandem.v1 import generation_pb2 as pb

    rows = []
    for n in lengths:
        ttft, tt2t, waits, sent = [], [], [], []
        for r in range(repeats + 1):  # the first run warms up
            pages0 = _metric(metrics_port, "tandem_kv_transfer_bytes_total")
            wait0 = _metric(metrics_port, "tandem_kv_transfer_wait_seconds_sum")
            ids = [(13 * i + 7 * n + r) % 200 + 20 for i in range(n)]
            t0 = time.perf_counter()
            stamps = []
            for resp in svc.stub.Generate(pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=ids), max_new_tokens=new_tokens, ignore_eos=True,
                    sampling=pb.SamplingParameters(temperature=0.0),
                    cache_salt=f"bench-{n}-{r}-{time.time()}"), timeout=1800):
                if resp.HasField("chunk") and resp.chunk.token_ids:
                    stamps.append(time.perf_counter())
            if r == 0:
                continue
            ttft.append(stamps[0] - t0)
            tt2t.append(stamps[1] - t0)
            sent.append(_metric(metrics_port, "tandem_kv_transfer_bytes_total") - pages0)
            waits.append(_metric(metrics_port, "tandem_kv_transfer_wait_seconds_sum") - wait0)
        rows.append({"prompt_tokens": n, "ttft_s": statistics.median(ttft),
                     "tt2t_s": statistics.median(tt2t), "transfer_bytes": statistics.median(sent),
                     "transfer_wait_s": statistics.median(waits)})
    return rows


# ------------------------------------------------------ raw link bandwidth


def _synthetic_store(device: str, pages: int, layers: int, page_size: int, kv_heads: int,
                     head_dim: int, fill: bool):
    """bf16 K and V pages shaped like a model's KV pool, as a StoreBuffers."""
    import torch

    from transfer.pages import StoreBuffers

    make = torch.randn if fill else torch.zeros
    kv = {f"kv.{layer}.{side}": make(pages, page_size, kv_heads, head_dim, device=device,
                                     dtype=torch.bfloat16)
          for layer in range(layers) for side in ("k", "v")}
    return StoreBuffers(kv, {})


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _raw_peer(args) -> dict:
    """Peer copies between two stores' buffers (two devices, or one device to itself)."""
    import torch

    src_dev, dst_dev = args.raw_devices
    shape = (args.raw_pages, args.raw_layers, args.page_size, args.kv_heads, args.head_dim)
    src = _synthetic_store(src_dev, *shape, fill=True)
    dst = _synthetic_store(dst_dev, *shape, fill=False)
    perm = torch.randperm(args.raw_pages)
    rows_src, rows_dst = src.rows(perm[:args.raw_move].tolist()), dst.rows(
        perm[-args.raw_move:].tolist())
    def once():
        for a, b in zip(src.kv, dst.kv):
            b.copy_rows(a, rows_src, rows_dst)
        _sync(dst_dev)
    once()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        once()
    seconds = (time.perf_counter() - t0) / args.repeats
    moved = args.raw_move * src.page_bytes()
    ok = all(torch.equal(ta[rows_src.cpu()].cpu(), tb[rows_dst.cpu()].cpu())
             for a, b in zip(src.kv, dst.kv) for ta, tb in zip(a.tensors, b.tensors))
    return {"method": f"peer copy {src_dev} -> {dst_dev}", "bytes": moved, "seconds": seconds,
            "gbs": moved / seconds / 1e9, "bit_exact": ok}


def _raw_rank(rank: int, port: int, args, results) -> None:
    import torch

    from transfer.group import GroupConfig, TransferGroup
    from transfer.inbox import Inbox
    from transfer.outbox import DistLink, OutgoingTransfer
    from transfer.protocol import TransferSpec

    device = args.raw_devices[rank]
    try:
        group = TransferGroup(GroupConfig(rank, 2, f"127.0.0.1:{port}", 1, timeout_s=300),
                              torch.device(device))
        group.start()
        group.wait_ready(120)
        shape = (args.raw_pages, args.raw_layers, args.page_size, args.kv_heads, args.head_dim)
        store = _synthetic_store(device, *shape, fill=rank == 0)
        table = tuple(range(args.raw_move))
        for r in range(args.repeats + 1):
            spec = TransferSpec(r + 1, 0, 0, tuple(range(args.raw_move)))
            if rank == 0:
                out = OutgoingTransfer(spec, DistLink(store, group) if r == 0 else link, table,
                                       args.page_size, args.raw_move * args.page_size)
                link = out.link
                out.finish(live_slot=-1)
            else:
                if r == 0:
                    inbox = Inbox(group, store, range(1))
                    inbox.start()
                incoming = inbox.register(f"r{r}", r + 1, 0, spec.dest_pages)
                if not incoming.done.wait(300) or incoming.error:
                    raise RuntimeError(incoming.error or "timed out")
                if r:
                    results.put((r, incoming.bytes, incoming.finished - incoming.started))
        if rank == 1:
            results.put(("backend", group.backend, None))
        else:
            time.sleep(2)
        group.close()
    except BaseException as e:
        results.put(("error", f"rank {rank} ({device}): {e!r}"[:500], None))


def _raw_dist(args) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_raw_rank, args=(r, port, args, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    got = []
    while not results.empty():
        got.append(results.get())
    errors = [g[1] for g in got if g[0] == "error"]
    if errors:
        return {"method": "torch.distributed", "error": "; ".join(errors)}
    backend = next(g[1] for g in got if g[0] == "backend")
    runs = [(b, s) for k, b, s in got if isinstance(k, int)]
    moved = sum(b for b, _ in runs) / len(runs)
    # the receiver's clock: registration to the last byte written (it registers before the
    # sender starts, so this includes the sender's gathers)
    seconds = sorted(s for _, s in runs)[len(runs) // 2]
    return {"method": f"torch.distributed {backend} {args.raw_devices[0]} -> "
                      f"{args.raw_devices[1]}", "bytes": moved, "seconds": seconds,
            "gbs": moved / seconds / 1e9}


def raw_main(args) -> int:
    copy_gbs = _copy_bandwidth(args.raw_devices[0])
    rows = [_raw_peer(args), _raw_dist(args)]
    print(f"\ntandem bench disagg --raw: {args.raw_move} pages of {args.raw_layers} layers x "
          f"{args.page_size} tokens x {args.kv_heads} KV heads x {args.head_dim} (bf16 K+V); "
          f"device copy {copy_gbs:.1f} GB/s on {args.raw_devices[0]}")
    for row in rows:
        if "error" in row:
            print(f"  {row['method']:<42} failed: {row['error']}")
        else:
            print(f"  {row['method']:<42} {row['bytes'] / 1e6:9.1f} MB in "
                  f"{row['seconds'] * 1e3:8.2f} ms = {row['gbs']:7.2f} GB/s"
                  + (f" (bit-exact {row['bit_exact']})" if "bit_exact" in row else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw": rows, "copy_gbs": copy_gbs}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench disagg", description=__doc__.splitlines()[0])
    add_service_arguments(p, max_context_tokens=16384)
    p.add_argument("--raw", action="store_true",
                   help="measure the links alone on synthetic pages (no model, no service)")
    p.add_argument("--raw-devices", default=None,
                   help="--raw: source,destination device (default: --device twice)")
    p.add_argument("--raw-pages", type=int, default=2048, help="--raw: pages per store")
    p.add_argument("--raw-move", type=int, default=1024, help="--raw: pages moved per transfer")
    p.add_argument("--raw-layers", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--kv-transfer", choices=["dist", "peer"], default="dist")
    p.add_argument("--devices", default=None, help="disaggregated: prefill,decode devices")
    args = p.parse_args(argv)
    if args.raw:
        devices = (args.raw_devices or f"{args.device},{args.device}").split(",")
        args.raw_devices = [d if d != "cuda" else "cuda:0" for d in devices]
        return raw_main(args)
    results = {}
    for topology in ("shared", "disaggregated"):
        extra = ["--max-batch", "4"]
        if topology == "disaggregated":
            extra += ["--topology", "disaggregated", "--kv-transfer", args.kv_transfer]
            if args.devices:
                extra += ["--devices", args.devices]
        metrics_port = free_port()
        extra += ["--metrics-port", str(metrics_port)]
        if args.weights:
            extra += ["--weights", args.weights]
        extra += args.serve_args.split()
        with Service(args.model, args.device, args.kv_format, args.max_context_tokens,
                     args.prefill_chunk, args.gpu_memory_budget, extra=tuple(extra)) as svc:
            results[topology] = _run(svc, metrics_port, args.prompt_tokens, args.repeats,
                                     args.new_tokens)
    device = args.device if args.device != "cuda" else "cuda:0"
    copy_gbs = _copy_bandwidth(device)
    print(f"\ntandem bench disagg: {args.model or 'embedded'} on {args.device}, "
          f"transfer {args.kv_transfer}, KV {args.kv_format}; device copy {copy_gbs:.1f} GB/s")
    print(f"{'prompt':>7} {'ttft shared':>12} {'ttft disagg':>12} {'tt2t shared':>12} "
          f"{'tt2t disagg':>12} {'moved MB':>9} {'tail ms':>8}")
    for shared, dis in zip(results["shared"], results["disaggregated"]):
        print(f"{shared['prompt_tokens']:>7} {shared['ttft_s'] * 1e3:>10.1f}ms "
              f"{dis['ttft_s'] * 1e3:>10.1f}ms {shared['tt2t_s'] * 1e3:>10.1f}ms "
              f"{dis['tt2t_s'] * 1e3:>10.1f}ms {dis['transfer_bytes'] / 1e6:>9.2f} "
              f"{dis['transfer_wait_s'] * 1e3:>8.1f}")
    print("(medians; tail = the router's wait after the prefill until the last byte arrived)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "copy_gbs": copy_gbs, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
