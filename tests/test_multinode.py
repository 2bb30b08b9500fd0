"""Two nodes on one machine: two `edu3d train` commands meet on loopback and train as one world.

Each command is a node (`--nnodes 2`, 4 ranks each, a c10d rendezvous on 127.0.0.1): together
they train dp2-tp2-pp2 with the losses of the same command on one node of 8 ranks, every
rank's global rank is its node's block of four in local-rank order, and every socket either
node's processes listen on is on loopback. A rank killed on one node ends both commands
within a bounded time, and both name it. A cold run leaves no `torchelastic_*` folder in
$TMPDIR (torchrun's log folder is inside the run folder).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edu3d.commands.train import check, parse
from edu3d.launch import runs
from edu3d.launch.api import loopback_only, node_args
from edu3d.launch.procs import running

EDU3D = [sys.executable, "-m", "edu3d.cli"]
TRAIN = ["train", "--dp", "2", "--tp", "2", "--pp", "2", "--steps", "3", "--json",
         "--layers", "2", "--d-model", "32", "--seq", "16"]



def _env(tmp_path: Path, name: str) -> dict:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "OMP_NUM_THREADS": "1", "EDU3D_RUNS": str(tmp_path / name),
            "TMPDIR": str(tmp_path / "tmp")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- what the processes of a run are and where they listen, from /proc ----------------------
def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _listening(pids: list[int]) -> set[str]:
    """``ADDRESS:PORT`` (hex, as /proc/net writes them) of every listening TCP socket of
    ``pids``."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.add(fields[1])
    return found


def _is_loopback(hex_addr: str) -> bool:
    if len(hex_addr) == 8:  # IPv4, little-endian: 127.x.y.z ends in 7F
        return hex_addr[-2:] == "7F"
    return (hex_addr == "00000000000000000000000001000000"  # ::1
            or hex_addr[:24] == "0000000000000000FFFF0000" and hex_addr[-2:] == "7F")


def _rank_env(pid: int) -> dict | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0")
                       if "=" in kv)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            is_rank = b"edu3d.launch.worker" in f.read()
    except OSError:
        return None
    return env if is_rank and "RANK" in env else None


def _two_nodes(tmp_path: Path, extra: list[str], timeout: float = 400.0, argv=None,
               env: dict | None = None, tick=None) -> dict:
    """Start two `edu3d train` nodes (or ``argv(node_options)``) on a fresh loopback port and
    wait for both; meanwhile look at their processes: every listening address, and each
    rank's environment, and call ``tick()``."""
    port = _free_port()
    nodes = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", f"test{port}"]
    t0 = time.monotonic()
    command = argv(nodes) if argv else EDU3D + TRAIN + extra + nodes
    procs = [subprocess.Popen(command, env={**_env(tmp_path, f"node{n}"), **(env or {})},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    seen = {"addresses": set(), "ranks": {}}  # ranks: {(node, pid): environment}
    outputs: list = [None, None]
    ended: list = [None, None]

    def wait(n: int) -> None:
        outputs[n] = procs[n].communicate(timeout=timeout)
        ended[n] = time.monotonic()

    waiters = [threading.Thread(target=wait, args=(n,), daemon=True) for n in (0, 1)]
    for w in waiters:
        w.start()
    try:
        while any(w.is_alive() for w in waiters) and time.monotonic() - t0 < timeout:
            for n, proc in enumerate(procs):
                pids = _descendants(proc.pid)
                seen["addresses"] |= _listening(pids)
                for pid in pids:
                    if (n, pid) not in seen["ranks"] and (env := _rank_env(pid)) is not None:
                        seen["ranks"][(n, pid)] = env
            if tick is not None:
                tick()
            time.sleep(0.2)
        for w in waiters:
            w.join(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return {"out": outputs, "codes": [p.returncode for p in procs], **seen, "port": port,
            "elapsed": time.monotonic() - t0, "ended": ended}


def _records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.timeout(900)  # hang guards of 400 s a run: 8 ranks import torch, busy machines
def test_two_nodes_on_loopback_train_as_one_world(tmp_path):
    single = subprocess.run(EDU3D + TRAIN, env=_env(tmp_path, "single"), capture_output=True,
                            text=True, timeout=400)
    assert single.returncode == 0, single.stderr[-3000:]
    reference = [r["loss"] for r in _records(single.stdout)]
    assert len(reference) == 3

    run = _two_nodes(tmp_path, [])
    (out0, err0), (out1, err1) = run["out"]
    assert run["codes"] == [0, 0], (err0[-3000:], err1[-3000:])
    # the node that holds rank 0 prints the records, the other none
    printed = [_records(out0), _records(out1)]
    assert sorted(map(len, printed)) == [0, 3], printed
    assert [r["loss"] for r in printed[0] or printed[1]] == reference  # bit-identical

    # global ranks: one block of four per node, in local-rank order, in one world of 8
    by_node: dict[int, list] = {0: [], 1: []}
    for (node, _), env in run["ranks"].items():
        assert env["WORLD_SIZE"] == "8" and env["LOCAL_WORLD_SIZE"] == "4", env
        assert int(env["RANK"]) == 4 * int(env["GROUP_RANK"]) + int(env["LOCAL_RANK"]), env
        by_node[node].append(int(env["RANK"]))
    blocks = sorted(sorted(ranks) for ranks in by_node.values())
    assert blocks == [[0, 1, 2, 3], [4, 5, 6, 7]], by_node
    assert printed[min(by_node, key=lambda n: min(by_node[n]))], "rank 0's node printed nothing"

    rendezvous = [a for a in run["addresses"] if a.endswith(f":{run['port']:04X}")]
    assert rendezvous, "never saw the rendezvous store listen: the check itself is broken"
    outside = sorted(a for a in run["addresses"] if not _is_loopback(a.split(":")[0]))
    assert not outside, f"listening outside loopback: {outside}"
    assert not list((tmp_path / "tmp").glob("torchelastic_*"))
    print(f"two nodes: {run['elapsed']:.1f} s, {len(run['addresses'])} listening sockets")


@pytest.mark.timeout(600)
def test_a_rank_killed_on_one_node_ends_both_naming_it(tmp_path):
    run = _two_nodes(tmp_path, ["--inject-fault", "rank=5,step=2,kind=kill"])
    (_, err0), (_, err1) = run["out"]
    assert run["codes"] == [1, 1], (err0[-3000:], err1[-3000:])
    for err in (err0, err1):
        assert "edu3d train: rank 5 failed: killed by signal SIGKILL" in err, err[-3000:]
    print(f"both nodes ended {run['elapsed']:.1f} s after they started")


LOOP = """\
import time
import torch
from edu3d.distributed import comm, runtime, trace
runtime.init()
t, s = torch.ones(4), 0
while True:  # until the run is ended from outside
    s += 1
    with trace.current().context(step=s):
        comm.all_reduce(t)
    time.sleep(0.005)
"""


def test_a_rank_stopped_on_the_node_without_rank_0_is_named_by_both(tmp_path):
    """Two nodes of two ranks all-reduce in a loop; ``kill -STOP`` on rank 3, on the node that
    does not hold rank 0. That node's heartbeat watches its own ranks, sees rank 3 stop
    beating and names it; the other node learns the verdict from the agents' shared
    failures. Both end, each naming rank 3, and no process of either is left (the node of
    rank 0 once blamed rank 0 for a deadlock, the other said nothing for minutes)."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    stopped: dict = {}

    def stop_rank_3() -> None:
        for run_dir in ([] if stopped else tmp_path.glob("node*/*")):
            pid = runs.pid_files(run_dir).get(3)
            if pid and (run_dir / "flight" / "rank3.json").exists():
                os.kill(pid, signal.SIGSTOP)
                stopped.update(t=time.monotonic(), run_dir=run_dir)
                return

    run = _two_nodes(tmp_path, [], timeout=150, tick=stop_rank_3, env={"EDU3D_TIMEOUT": "12"},
                     argv=lambda nodes: EDU3D + ["run", "-n", "2", *nodes, str(script)])
    (_, err0), (_, err1) = run["out"]
    assert stopped and run["codes"] == [1, 1], (err0[-2000:], err1[-2000:])
    for err in (err0, err1):
        assert "edu3d run: rank 3 failed:" in err, err[-2000:]
        assert "its flight record stopped beating: the process is stopped by a signal" in err
        assert "rank 0 recorded no operation" not in err  # each node reports its own ranks
    left = [pid for run_dir in tmp_path.glob("node*/*") for pid in runs.pid_files(run_dir).values()
            if running(pid) and runs.belongs_to(pid, runs.run_id(run_dir))]
    assert not left, f"processes left running: {left}"
    print("kill -STOP on rank 3 (heartbeat 6 s): " + ", ".join(
        f"node{n} ended {end - stopped['t']:.1f} s after" for n, end in enumerate(run["ended"])))


# ---- the options, checked before any process starts ----------------------------------------
def test_node_options_become_torchrun_options_and_bad_ones_one_line():
    assert node_args() == [] and node_args(nnodes=1) == []
    assert node_args(8, nnodes=2, rdzv_endpoint="127.0.0.1:29400", node_rank=1) == [
        "--nnodes=2", "--node-rank=1", "--rdzv-endpoint=127.0.0.1:29400"]
    for kwargs, words in (({"nnodes": 2, "node_rank": 2}, "0..1"),
                          ({"nnodes": 3, "world_size": 8}, "divides 8"),
                          ({"master_port": 70000}, "1..65535")):
        with pytest.raises(ValueError, match=words):
            node_args(**kwargs)


@pytest.mark.parametrize("flags, words", [
    (["--nnodes", "3"], "8 ranks cannot be shared evenly by --nnodes 3"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2: with --nnodes 2"),
    (["--nnodes", "2", "--ckpt-dir", "ck", "--max-restarts", "1"], "drop --max-restarts"),
])
def test_train_refuses_bad_node_options(flags, words):
    options = parse(TRAIN[1:] + flags)
    with pytest.raises(ValueError, match=words):
        check(options)


def test_train_takes_runs_node_flags(tmp_path):
    options = parse(TRAIN[1:] + ["--nnodes", "2", "--node-rank", "1", "--master-port", "29400",
                                 "--rdzv-endpoint", "127.0.0.1:29400"])
    nodes = options.launch
    assert (nodes.nnodes, nodes.node_rank, nodes.master_port) == (2, 1, 29400)
    assert nodes.rdzv_endpoint == "127.0.0.1:29400"
    for command in ("run", "train"):
        text = subprocess.run(EDU3D + [command, "--help"], capture_output=True, text=True).stdout
        for flag in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend",
                     "--rdzv-id", "--master-addr", "--master-port"):
            assert flag in text, (command, flag)
    bad = subprocess.run(EDU3D + ["run", "-n", "2", "--nnodes", "2", "--node-rank", "5",
                                  "x.py"], capture_output=True, text=True,
                         env=_env(tmp_path, "runs"))
    assert bad.returncode == 2
    assert bad.stderr.strip() == "edu3d run: --node-rank 5: with --nnodes 2 the nodes are " \
                                 "numbered 0..1"


def test_loopback_unless_the_user_names_another_address():
    assert loopback_only([])
    assert loopback_only(["--nnodes=2"])  # torchrun's own default master is 127.0.0.1
    assert loopback_only(["--nnodes=2", "--rdzv-endpoint=127.0.0.1:29400"])
    assert loopback_only(["--rdzv-endpoint=localhost:29400", "--local-addr=127.0.0.2"])
    assert loopback_only(["--master-addr=[::1]", "--master-port=29400"])
    assert not loopback_only(["--nnodes=2", "--rdzv-endpoint=10.0.0.5:29400"])
    assert not loopback_only(["--nnodes=2", "--master-addr=node0.cluster"])
    assert not loopback_only(["--nnodes=2", "--rdzv-endpoint=127.0.0.1:1",
                              "--local-addr=192.168.1.4"])


def test_a_cold_run_leaves_no_torchelastic_folder_in_tmpdir(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("print('hi')\n")
    env = _env(tmp_path, "runs")
    p = subprocess.run(EDU3D + ["run", "-n", "2", str(script)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert not list((tmp_path / "tmp").glob("torchelastic_*"))
    folder = next((tmp_path / "runs").iterdir())
    assert (folder / "torchelastic").is_dir()  # torchrun's log folder, inside the run's
