"""PyTorch's own DDP tutorial (tests/python/real/ddp_tutorial: the real
multigpu_torchrun.py and datautils.py, with their license), run on the CPU and
ported as docs/python.md says (its imports and one line), under
`nonstop run --nproc 4 --spares 1`:
its snapshot code, its batch peek before set_epoch and all. A kill of rank 2,
then of rank 0, in epoch 1: the spare runs the script from its first line,
loads rank 0's snapshot of epoch 0 over the state it copied, and must still
train from the peers' state (docs/recovery.md, "The peers' state wins")."""

import difflib
import pathlib
import re

import pytest

from conftest import run_job

REAL = pathlib.Path(__file__).resolve().parent / "real"
TUTORIAL = REAL / "ddp_tutorial"
HARNESS = REAL / "run_public.py"
FINAL = re.compile(r"\[rank (\d)\] final params (\w+)")

# The lines any CPU user of torchrun changes too (Gloo, no GPU): not counted.
CPU_FORM = [
    ('    init_process_group(backend="nccl")\n    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n',
     '    init_process_group(backend="gloo")\n'),
    ('self.model = model.to(self.gpu_id)', 'self.model = model.to("cpu")'),
    ('DDP(self.model, device_ids=[self.gpu_id])', 'DDP(self.model, device_ids=None)'),
    ('loc = f"cuda:{self.gpu_id}"', 'loc = "cpu"'),
    ('source = source.to(self.gpu_id)', 'source = source.to("cpu")'),
    ('targets = targets.to(self.gpu_id)', 'targets = targets.to("cpu")'),
]


def changed_lines():
    """(import lines, other lines) the port changes in the tutorial's CPU form."""
    cpu = (TUTORIAL / "multigpu_torchrun.py").read_text()
    for before, after in CPU_FORM:
        assert before in cpu, f"the real tutorial no longer has {before!r}"
        cpu = cpu.replace(before, after)
    ported = (TUTORIAL / "multigpu_nonstop.py").read_text()
    diff = [line for line in difflib.unified_diff(cpu.splitlines(), ported.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    imports = [line for line in diff if line[1:].startswith(("import ", "from "))]
    return imports, [line for line in diff if line not in imports]


def test_the_port_of_the_real_tutorial_changes_its_imports_and_one_line():
    imports, others = changed_lines()
    assert len(imports) == 10, imports
    assert others == ["+    @nonstop.torch.step"], others


# The port as it is: the script's init_process_group(backend="gloo") joins first, and its DDP
# registers the state (a spare copies the peers' state there, after its setup). "registered":
# the state registered before the setup, init_process_group(model, optimizer, loader) in place of
# ddp_setup() (a spare copies the peers' state at once, and its setup's snapshot load is undone
# at the first step).
FORMS = {"join-first": None,
         "registered": ("    ddp_setup()\n    dataset, model, optimizer = load_train_objs()\n"
                        "    train_data = prepare_dataloader(dataset, batch_size)\n",
                        "    dataset, model, optimizer = load_train_objs()\n"
                        "    train_data = prepare_dataloader(dataset, batch_size)\n"
                        "    init_process_group(model, optimizer, train_data)\n")}


def tutorial(tmp_path, name, inject, form="join-first"):
    run = tmp_path / name
    run.mkdir()  # its own snapshot.pt
    script = TUTORIAL / "multigpu_nonstop.py"
    if FORMS[form] is not None:
        before, after = FORMS[form]
        text = script.read_text()
        assert before in text, "the port's main() changed"
        script = run / "multigpu_registered.py"
        script.write_text(text.replace(before, after))
        (run / "datautils.py").write_text((TUTORIAL / "datautils.py").read_text())
    flags = ["--nproc", "4", "--spares", "1", "--inject", inject]
    job = run_job(run, name, flags, ["--mse", str(script), "3", "1"], script=HARNESS, timeout=400)
    assert job.code == 0, job.output
    finals = dict(FINAL.findall(job.output))
    assert sorted(finals) == ["0", "1", "2", "3"], job.output
    return job, finals


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return tutorial(tmp_path_factory.mktemp("clean"), "clean", "none")


# 2048 samples in global batches of 4 x 32: 16 steps an epoch. Rank 0 saves
# snapshot.pt after epoch 0 (step 15); the kill lands in epoch 1.
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("rank", [2, 0])
def test_the_real_tutorial_survives_a_kill_bitwise_despite_its_snapshot_load(clean, tmp_path, rank, form):
    _, clean_finals = clean
    assert len(set(clean_finals.values())) == 1, clean_finals
    job, finals = tutorial(tmp_path, f"kill{rank}", f"kill:rank={rank},step=20", form)
    assert len(job.events("recovery_end")) == 1, job.output
    assert "Resuming training from snapshot at Epoch 0" in job.output, "the spare loaded the snapshot"
    if form == "registered":
        assert "the program's setup changed" in job.output, "the spare's setup changed the copied state"
    else:
        assert "copied the state of step 19" in job.output, "the spare copied the peers' state after its setup"
    assert finals == clean_finals, "every rank ends on the fault-free run's bits"
