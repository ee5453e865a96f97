"""What the checkpoint tests share: states to save, a run's contents, loaded states compared
down to the sharing of storages, forged checkpoints loaded, manifests rewritten with their
checksums redone, the process's peak memory, and runs killed at a given moment."""

from __future__ import annotations

import multiprocessing
import re
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import torch
import xxhash

import asyncstore
from asyncstore.checkpoint import _format as fmt
from asyncstore.checkpoint import read_manifest

from ..conftest import unique
from ..helpers import same_bits

# -- states ------------------------------------------------------------------------------------

CHUNK = 256 * 1024  # the chunk size of the differential saves
TENSORS = 20  # tensors in base_state(), one chunk each


def state_of(step: int) -> dict[str, Any]:
    """A small state whose values say its step."""
    return {"w": torch.full((1000,), float(step)), "step": step}


def base_state() -> dict[str, Any]:
    """``TENSORS`` random tensors of one chunk each: nothing compresses, so the bytes a
    differential save writes are exact."""
    gen = torch.Generator().manual_seed(0)
    return {f"t{i:02d}": torch.randn(CHUNK // 4, generator=gen) for i in range(TENSORS)}


def changed(state: dict[str, Any], fraction: float, seed: int) -> dict[str, Any]:
    """A copy of ``state`` with the first ``fraction`` of its tensors (by name) changed."""
    out = {k: v.clone() for k, v in state.items()}
    for key in sorted(out)[: round(TENSORS * fraction)]:
        out[key].add_(float(seed))
    return out


# -- a run's contents --------------------------------------------------------------------------


async def contents(
    url: str | Path, options: dict[str, Any] | None = None
) -> tuple[list[str], set[str], set[str]]:
    """A run's version keys, the packs they point into, and every other key there."""
    versions: list[str] = []
    others: set[str] = set()
    async with asyncstore.open_store(str(url), **(options or {})) as store:
        async for info in store.list(""):
            if re.fullmatch(r"step-\d{9}\.ckpt", info.key):
                versions.append(info.key)
            else:
                others.add(info.key)
        named: set[str] = set()
        for key in versions:
            named.update((await read_manifest((store, key))).packs)
    return sorted(versions), named, others


async def assert_tidy(url: str | Path, options: dict[str, Any] | None = None) -> list[str]:
    """Assert that a run holds versions and the packs they point into, nothing else (no
    temp file, no pack nothing points into, no pack missing); its version keys."""
    versions, named, others = await contents(url, options)
    assert others == named, (sorted(others - named), sorted(named - others))
    if isinstance(url, Path) and url.exists():
        # What a listing does not show: temp files of unfinished writes.
        hidden = [
            p
            for p in url.rglob("*")
            if p.is_file() and str(p.relative_to(url)) not in others | set(versions)
        ]
        assert not hidden, hidden
    return versions


# -- loaded states -----------------------------------------------------------------------------


def tensors_in(obj: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a nested state, with its path, in order."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in tensors_in(v, f"{path}/{k}")]
    if isinstance(obj, list | tuple):
        return [t for i, v in enumerate(obj) for t in tensors_in(v, f"{path}/{i}")]
    return []


def without_tensors(obj: Any) -> Any:
    """A nested state with each tensor replaced by ``None``: what is left to compare."""
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, dict):
        return {k: without_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [without_tensors(v) for v in obj]
    return obj


def assert_same_storage_layout(saved: Any, loaded: Any) -> None:
    """Assert that ``loaded`` is ``saved`` again as the checkpoint format promises: tensor for
    tensor the same type, bytes, strides and storage offset, two tensors sharing a storage
    exactly where they shared one when saved, and equal values around them."""
    before, after = tensors_in(saved), tensors_in(loaded)
    assert [p for p, _ in before] == [p for p, _ in after]
    for (path, a), (_, b) in zip(before, after, strict=True):
        assert same_bits(a, b), path
        assert a.stride() == b.stride(), path
        assert a.storage_offset() == b.storage_offset(), path
        assert type(a) is type(b), path
    owners = [a.untyped_storage().data_ptr() for _, a in before]
    again = [b.untyped_storage().data_ptr() for _, b in after]
    for i in range(len(owners)):
        for j in range(len(owners)):
            if before[i][1].untyped_storage().nbytes() and before[j][1].untyped_storage().nbytes():
                assert (owners[i] == owners[j]) == (again[i] == again[j])
    assert without_tensors(saved) == without_tensors(loaded)


# -- crafted checkpoints -----------------------------------------------------------------------


async def load_forged(blob: bytes, **options: Any) -> Any:
    """Load the checkpoint ``blob`` from a memory store, with ``options``."""
    async with asyncstore.open_store(f"memory://{unique()}") as store:
        await store.put("k", blob)
        return await asyncstore.load((store, "k"), **options)


def rewrite_manifest(blob: bytes, edit: Any) -> bytes:
    """The checkpoint ``blob`` with its manifest changed by ``edit`` and every checksum over
    it redone: the checksums then hold, and only the loader's layout checks stand between
    the crafted manifest and the reader."""
    footer = fmt.decode_footer(blob[-fmt.FOOTER_SIZE :], "test")
    assert footer is not None
    start, end = footer.manifest_offset, footer.manifest_offset + footer.manifest_length
    manifest = edit(fmt.decode_manifest(blob[start:end], footer, "test"))
    manifest = msgspec.structs.replace(manifest, digest=fmt.digest_of(manifest))
    encoded = fmt.encode_manifest(manifest)
    new_footer = msgspec.structs.replace(
        footer, manifest_length=len(encoded), manifest_xxh3=xxhash.xxh3_64_intdigest(encoded)
    )
    return blob[:start] + encoded + fmt.encode_footer(new_footer)


def rewrite_manifest_file(path: Path, edit: Any) -> None:
    """:func:`rewrite_manifest` on the checkpoint file at ``path``, in place."""
    path.write_bytes(rewrite_manifest(path.read_bytes(), edit))


# -- memory ------------------------------------------------------------------------------------


def peak_rss() -> int:
    """This process's peak resident memory since the last :func:`reset_peak_rss`, bytes."""
    status = Path("/proc/self/status").read_text()
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    assert match is not None
    return int(match.group(1)) * 1024


def reset_peak_rss() -> None:
    """Reset the peak that :func:`peak_rss` reports to the current resident memory."""
    Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS


# -- killed runs -------------------------------------------------------------------------------

# Killed runs start from a server process that imported torch and asyncstore once: each run
# is a fork of it (about 50 ms) instead of a new interpreter (about 2 s of imports here), and
# starts as clean as one (the server runs nothing of the tests).
_KILLED_RUNS = multiprocessing.get_context("forkserver")
_KILLED_RUNS.set_forkserver_preload(["torch", "asyncstore.checkpoint"])


def _run_script(source: str, argv: list[str]) -> None:
    sys.argv = ["-c", *argv]
    exec(compile(source, "<killed run>", "exec"), {"__name__": "__main__"})


def run_until_killed(script: str, *argv: str) -> None:
    """Run the Python source ``script`` with ``sys.argv[1:] == argv`` in a new process, which
    must end killed by SIGKILL (no cleanup of any kind): the script arms its own timer. Its
    output, on failure, is in the test's captured output."""
    proc = _KILLED_RUNS.Process(target=_run_script, args=(textwrap.dedent(script), list(argv)))
    proc.start()
    proc.join(120)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError(f"the killed run was still running after 120 s: {script[:200]}")
    assert proc.exitcode == -signal.SIGKILL, f"the run ended with {proc.exitcode}, not killed"
