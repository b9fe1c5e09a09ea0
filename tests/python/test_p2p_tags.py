"""Point-to-point messages matched by their tag, as Gloo matches them (docs/python.md,
"torch.distributed over nonstop"): a receive takes the first message of its tag from its peer,
whatever came before it, and a receive from any source the first of its tag from any rank."""

import re

from conftest import run_job

SCRIPT = """
import torch, torch.distributed as dist, nonstop.torch
nonstop.torch.init_process_group(backend="nonstop")
rank = dist.get_rank()
if rank == 0:
    for tag in (1, 2, 3):  # to rank 1, in this order
        dist.send(torch.full((4,), float(tag)), 1, tag=tag)
    dist.send(torch.full((2,), 7.0), 2, tag=7)
    dist.send(torch.full((2,), 5.0), 2, tag=5)
    dist.send(torch.empty(0), 2, tag=10)  # an empty message, read ahead of tag 11's
    dist.send(torch.full((1,), 11.0), 2, tag=11)
    for tag in (8, 9):  # from any source, by tag: rank 2 sends 8, rank 1 sends 9
        t = torch.zeros(1)
        dist.recv(t, tag=tag)
        print(f"[tags] rank 0 any-source tag {tag} = {t.item():g}", flush=True)
    try:
        dist.recv(torch.zeros(3), 1, tag=4)  # rank 1 sends 2 elements
    except RuntimeError as e:
        print(f"[tags] rank 0 size mismatch: {e}", flush=True)
elif rank == 1:
    bufs = {tag: torch.zeros(4) for tag in (3, 1, 2)}
    works = [dist.irecv(bufs[tag], 0, tag=tag) for tag in (3, 1, 2)]  # not in the order sent
    for w in works:
        w.wait()
    print("[tags] rank 1 " + " ".join(f"{tag}={bufs[tag][0].item():g}" for tag in (3, 1, 2)), flush=True)
    dist.send(torch.tensor([19.0]), 0, tag=9)
    dist.send(torch.zeros(2), 0, tag=4)
else:
    a, b = torch.zeros(2), torch.zeros(2)
    dist.recv(a, 0, tag=5)
    dist.recv(b, 0, tag=7)
    print(f"[tags] rank 2 5={a[0].item():g} 7={b[0].item():g}", flush=True)
    c, empty = torch.zeros(1), torch.empty(0)
    dist.recv(c, 0, tag=11)
    dist.recv(empty, 0, tag=10)
    print(f"[tags] rank 2 11={c[0].item():g} then the empty one", flush=True)
    dist.send(torch.tensor([28.0]), 0, tag=8)
dist.barrier()
nonstop.torch.destroy_process_group()
"""


def test_a_receive_takes_the_first_message_of_its_tag(tmp_path):
    script = tmp_path / "tags.py"
    script.write_text(SCRIPT)
    job = run_job(tmp_path, "tags", ["--nproc", "3", "--spares", "0", "--inject", "none"], script=script,
                  timeout=120)
    assert job.code == 0, job.output
    lines = re.findall(r"\[tags\] (.*)", job.output)
    assert "rank 1 3=3 1=1 2=2" in lines, lines
    assert "rank 2 5=5 7=7" in lines, lines
    assert "rank 2 11=11 then the empty one" in lines, lines
    assert "rank 0 any-source tag 8 = 28" in lines and "rank 0 any-source tag 9 = 19" in lines, lines
    assert any(line.startswith("rank 0 size mismatch: rank 1 sent a message of tag 4 of 8 bytes to a receive of "
                               "12 bytes") for line in lines), lines
