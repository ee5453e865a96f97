"""``Checkpointer.save_training_state`` / ``load_training_state``: the model, every moment of
the optimizer and the user's values, saved through DCP and loaded back exactly; an
optimizer state never half-loaded; distributed saves counted in ``stats()``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

import asyncstore.torch
from asyncstore import InvalidArgument, NotFound
from asyncstore.metrics import prometheus

from ..ranks import spawn_ranks, wait_ranks

# One process: DCP warns that it saves and loads without a process group.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    data = torch.Generator().manual_seed(len(list(model.parameters())) + steps)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(32, 8, generator=data)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_training_state_round_trips_with_every_moment(run_url: Any) -> None:
    url, options = run_url
    model, optimizer = build()
    train(model, optimizer, 5)
    with asyncstore.torch.Checkpointer(url, store_options=options) as ckpt:
        done = ckpt.save_training_state(
            5, model, optimizer, extra={"epoch": 2, "rng": torch.arange(4)}
        )
        done.result(timeout=120)
        fresh, fresh_optimizer = build(seed=1)
        extra: dict[str, Any] = {"epoch": 0, "rng": torch.zeros(4, dtype=torch.long)}
        assert ckpt.load_training_state(fresh, fresh_optimizer, extra=extra) == 5
    assert extra["epoch"] == 2
    assert torch.equal(extra["rng"], torch.arange(4))
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    for index, moments in saved["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded["state"][index][key], moments[key]), (index, key)
    # The proof that counts: training goes on exactly as it would have.
    assert train(fresh, fresh_optimizer, 5) == train(model, optimizer, 5)


def test_a_fresh_run_resumes_from_nothing_and_a_missing_step_is_named(tmp_path: Path) -> None:
    model, optimizer = build()
    with asyncstore.torch.Checkpointer(tmp_path / "run") as ckpt:
        assert ckpt.load_training_state(model, optimizer) is None
        ckpt.save_training_state(1, model, optimizer, blocking=True).result(timeout=0)
        assert [(v.step, v.kind) for v in ckpt.versions()] == [(1, "dcp")]
        with pytest.raises(NotFound, match="of step 7"):
            ckpt.load_training_state(model, optimizer, step=7)


def test_a_template_without_moments_is_refused_not_half_loaded(tmp_path: Path) -> None:
    # docs/distributed.md used to put optimizer.state_dict() of a fresh optimizer in the
    # template: DCP loaded the learning rates and silently skipped exp_avg / exp_avg_sq.
    model, optimizer = build()
    train(model, optimizer, 3)
    with asyncstore.torch.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save_training_state(3, model, optimizer, blocking=True)
        fresh, fresh_optimizer = build(seed=1)
        template = {"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict()}
        with pytest.raises(
            InvalidArgument, match=r"optim\.state\.0\.bias\.exp_avg.*get_state_dict"
        ):
            ckpt.dcp_load(template)
        assert fresh_optimizer.state_dict()["state"] == {}
        # On purpose, it loads what the template holds.
        assert ckpt.dcp_load(template, partial_optimizer=True) == 3
        assert template["optim"]["param_groups"][0]["lr"] == 1e-2
        # The model alone is not an optimizer's state: loading only it is fine.
        only_model = {"model": build(seed=2)[0].state_dict()}
        assert ckpt.dcp_load(only_model) == 3
        assert torch.equal(only_model["model"]["0.weight"], model.state_dict()["0.weight"])


def test_parameters_the_optimizer_had_no_state_for_yet_resume_without_it(
    tmp_path: Path,
) -> None:
    # An unused head (an expert no token reached): its parameters have no AdamW state when
    # the checkpoint is saved, though get_state_dict gives the template some.
    def heads(seed: int) -> tuple[torch.nn.ModuleDict, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "idle": torch.nn.Linear(4, 4)})
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, optimizer = heads(0)
    for _ in range(2):
        loss = model["used"](torch.randn(3, 4)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with asyncstore.torch.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save_training_state(2, model, optimizer, blocking=True)
        fresh, fresh_optimizer = heads(1)
        assert ckpt.load_training_state(fresh, fresh_optimizer) == 2
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert sorted(loaded) == sorted(saved) == [0, 1]  # the idle head's: none, as saved
    for index, moments in saved.items():
        for key, value in moments.items():
            assert torch.equal(loaded[index][key], value), (index, key)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_a_run_of_single_object_versions_only_is_a_fresh_start_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = build()
    with asyncstore.torch.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(model.state_dict(), 4).result(timeout=60)
        assert ckpt.load_training_state(model, optimizer) is None
    assert "only versions saved with save() (steps 4)" in caplog.text


def test_another_optimizer_is_refused(tmp_path: Path) -> None:
    model, optimizer = build()
    train(model, optimizer, 2)
    with asyncstore.torch.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save_training_state(2, model, optimizer, blocking=True)
        other = build(seed=1)[0]
        sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
        # SGD's param_groups hold a momentum the checkpoint lacks.
        with pytest.raises(CheckpointException, match=r"Missing key .*param_groups\.0\.momentum"):
            ckpt.load_training_state(other, sgd)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c, m, o: c.save_training_state(1, "model", o), "model='model'"),
        (lambda c, m, o: c.save_training_state(1, m, object()), "optimizer=<object"),
        (lambda c, m, o: c.save_training_state(1, m, o, extra={1: 2}), "extra="),
        (lambda c, m, o: c.save_training_state(-1, m, o), "-1"),
        (lambda c, m, o: c.load_training_state(m, o, extra=[1]), "extra=\\[1\\]"),
    ],
)
def test_bad_arguments_are_named(tmp_path: Path, call: Any, message: str) -> None:
    model, optimizer = build()
    with asyncstore.torch.Checkpointer(tmp_path / "run") as ckpt:
        with pytest.raises(InvalidArgument, match=message):
            call(ckpt, model, optimizer)
        assert ckpt.versions() == []


def test_distributed_saves_are_counted_in_stats(tmp_path: Path) -> None:
    model, optimizer = build()
    with asyncstore.torch.Checkpointer(tmp_path / "run", keep_last=5) as ckpt:
        for step in (1, 2):
            train(model, optimizer, 1)
            ckpt.save_training_state(step, model, optimizer).result(timeout=120)
        ckpt.dcp_save({"model": model.state_dict()}, 3)
        stats = ckpt.stats()
        registry = CollectorRegistry()
        prometheus.register(registry)
        scraped = {
            sample.name: sample.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for sample in family.samples
            if sample.labels.get("component") == "checkpointer"
            and sample.labels.get("name") == ckpt.url
        }
    rank_objects = sorted((tmp_path / "run").glob("step-*.dcp/__0_*.ckpt"))
    assert len(rank_objects) == 3
    assert stats.saves == 3
    assert stats.failed == 0
    assert stats.bytes_written == sum(path.stat().st_size for path in rank_objects)
    assert 0 < stats.last_blocking_seconds <= stats.last_total_seconds
    assert stats.blocking_seconds >= stats.last_blocking_seconds
    # Prometheus shows the same figures.
    assert scraped["asyncstore_checkpoint_saves_total"] == 3
    assert scraped["asyncstore_checkpoint_bytes_written_total"] == stats.bytes_written
    assert scraped["asyncstore_checkpoint_blocking_seconds_total"] == stats.blocking_seconds
    assert scraped["asyncstore_checkpoint_last_total_seconds"] == stats.last_total_seconds


def test_one_async_save_at_a_time_and_close_waits_for_the_last(tmp_path: Path) -> None:
    model, optimizer = build()
    ckpt = asyncstore.torch.Checkpointer(tmp_path / "run", keep_last=5)
    first = ckpt.save_training_state(1, model, optimizer)
    second = ckpt.save_training_state(2, model, optimizer)
    assert first.done()  # the second call waited for it
    # A load waits too: its collectives would share the group with the save's.
    assert ckpt.load_training_state(*build(seed=1)) in (1, 2)
    assert second.done()
    third = ckpt.save_training_state(3, model, optimizer)
    ckpt.close()
    assert third.done()
    with asyncstore.torch.Checkpointer(tmp_path / "run") as again:
        assert [v.step for v in again.versions()] == [1, 2, 3]


SHARED_GROUP_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
from torch.distributed.checkpoint import state_dict_saver
import asyncstore.torch as at
from asyncstore import InvalidArgument

run = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
state = {"w": torch.full((4,), float(rank)), "step": 1}
with at.Checkpointer(run) as ckpt:
    # As docs once wrote it: the background save's collectives on the default group.
    try:
        state_dict_saver.async_save(state, storage_writer=ckpt.dcp_writer(1)).result(timeout=60)
    except Exception as exc:
        # Raised as itself before any collective, not gathered from the ranks by one.
        plain = isinstance(exc, InvalidArgument) and "in the background" in str(exc)
        print("REFUSED" if plain else f"OTHER {exc!r}")
    else:
        print("SAVED")
    # On the checkpointer's group, the same call saves.
    state_dict_saver.async_save(
        state, storage_writer=ckpt.dcp_writer(2), process_group=ckpt.dcp_group()
    ).result(timeout=60)
    # A blocking save on a thread of its own (the training's, as some launchers run it) has
    # nothing beside it: not refused.
    import threading
    saver = threading.Thread(
        target=state_dict_saver.save, args=(state,), kwargs={"storage_writer": ckpt.dcp_writer(3)}
    )
    saver.start()
    saver.join()
    dist.barrier()
    print("VERSIONS", [v.step for v in ckpt.versions()])
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def test_a_background_save_on_the_default_group_is_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    procs = spawn_ranks(SHARED_GROUP_SCRIPT, 2, str(tmp_path / "run"))
    outputs = wait_ranks(procs, timeout=120)
    for output in outputs:
        assert "REFUSED" in output, output
        assert "VERSIONS [2, 3]" in output, output


FSDP_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
import asyncstore.torch as at

run, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
for layer in (net[0], net[2], net):
    fully_shard(layer)  # FSDP2: every parameter a DTensor sharded across the 2 ranks
optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(rank)
for _ in range(3):
    loss = net(torch.randn(8, 16, generator=data)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
with at.Checkpointer(run) as ckpt:
    ckpt.save_training_state(3, net, optimizer, extra={"epoch": 7}).result(timeout=120)
full = get_state_dict(net, optimizer, options=StateDictOptions(full_state_dict=True))
if rank == 0:
    torch.save(full, out)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def test_an_fsdp_job_saved_by_two_ranks_loads_whole_in_one_process(tmp_path: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "full.pt"
    wait_ranks(spawn_ranks(FSDP_SCRIPT, 2, str(run), str(out)), timeout=120)
    full: Any = torch.load(out)
    model_full, optim_full = full
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra: dict[str, Any] = {"epoch": 0}
    with asyncstore.torch.Checkpointer(run) as ckpt:
        assert ckpt.load_training_state(model, optimizer, extra=extra) == 3
    assert extra == {"epoch": 7}
    assert sorted(model.state_dict()) == sorted(model_full)
    for name, value in model_full.items():
        assert torch.equal(model.state_dict()[name], value), name
    loaded: Any = get_state_dict(model, optimizer)[1]
    for name, moments in optim_full["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["state"][name][key], moments[key]), (name, key)


RESTART_COUNT_SCRIPT = """
import os, sys
# torchelastic agents on different nodes may count restarts differently.
os.environ["TORCHELASTIC_RESTART_COUNT"] = os.environ["RANK"]
import torch, torch.distributed as dist
import asyncstore.torch as at

dist.init_process_group("gloo")
with at.Checkpointer(sys.argv[1]) as ckpt:
    group = ckpt.dcp_group()
    total = torch.ones(1)
    dist.all_reduce(total, group=group)  # the ranks found each other under one name
    print("SUM", int(total.item()))
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def test_ranks_that_count_restarts_differently_still_make_one_group(tmp_path: Path) -> None:
    outputs = wait_ranks(spawn_ranks(RESTART_COUNT_SCRIPT, 2, str(tmp_path / "run")), timeout=60)
    assert all("SUM 2" in output for output in outputs), outputs


class Custom:
    """A value of the user's own class, which torch's restricted unpickler refuses."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_a_runs_loads_are_weights_only_unless_told(tmp_path: Path) -> None:
    # A plain StorageReader follows DCP's own rule (weights_only=False); a Checkpointer's
    # loads stay as its load() does: restricted by default.
    from asyncstore import UnsafeCheckpoint

    with asyncstore.torch.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.dcp_save({"obj": Custom(7), "step": 1}, 1)
        with pytest.raises(UnsafeCheckpoint, match="'obj'"):
            ckpt.dcp_load({"obj": None, "step": 0})
        trusted: dict[str, Any] = {"obj": None, "step": 0}
        assert ckpt.dcp_load(trusted, weights_only=False) == 1
        assert isinstance(trusted["obj"], Custom)
        assert trusted["obj"].value == 7
        assert ckpt.dcp_reader().weights_only is True
        assert ckpt.dcp_reader(weights_only=False).weights_only is False
