"""vLLM's and TRL's own code, unchanged, over ctrlcomm's group put under vLLM's name
(``ctrlcomm.vllm.install()``). Real processes and sockets; where a GPU would be needed, NCCL
(its library, and the communicator's GPU steps), CUDA's device query and TRL's vLLM server
are local stand-ins; the control plane is real.

scripts/test installs the consumers (.ci/consumers.txt: vLLM's wheel without its
dependencies, the few pure-Python modules its CPU paths import, TRL); without them these
tests skip."""

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

from ctrlcomm.testing import free_port, run_ranks

pytestmark = pytest.mark.vllm

vllm_utils = pytest.importorskip("vllm.distributed.utils", reason="vLLM is not installed")


# ------------------------------------------------------------------ stand-ins


class StandInNccl:
    """NCCL's library as vLLM's PyNcclCommunicator uses it to form a communicator, on a
    machine without a GPU: a random unique id on rank 0; ncclCommInitRank (the step that
    needs the GPU) records the id each rank brought."""

    def __init__(self, *args, **kwargs):
        self.inits = []

    def ncclGetRawVersion(self):  # noqa: N802  (NCCL's names)
        return 23206

    def ncclGetVersion(self):  # noqa: N802
        return "2.32.6"

    def ncclGetUniqueId(self):  # noqa: N802
        from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId

        uid = ncclUniqueId()
        ctypes.memmove(uid.internal, os.urandom(128), 128)
        return uid

    def ncclCommInitRank(self, world_size, unique_id, rank):  # noqa: N802
        self.inits.append((world_size, bytes(unique_id.internal), rank))
        return object()


def stand_in_nccl():
    """PyNcclCommunicator with NCCL and its GPU steps stood in for: its __init__ runs as it
    is (the isinstance check, the unique id broadcast through the group); _init_comm makes
    the communicator through the stand-in library without touching a device; broadcast
    records what it would move."""
    from vllm.distributed.device_communicators import pynccl

    pynccl.NCCLLibrary = StandInNccl

    def init_comm(self, device):
        self.device = device
        self.comm = self.nccl.ncclCommInitRank(self.world_size, self.unique_id, self.rank)

    def broadcast(self, tensor, src, stream=None):
        self.moved = [*getattr(self, "moved", []), (tuple(tensor.shape), str(tensor.dtype), src)]

    pynccl.PyNcclCommunicator._init_comm = init_comm
    pynccl.PyNcclCommunicator.broadcast = broadcast
    return pynccl.PyNcclCommunicator


def trl_vllm_client():
    """TRL 0.29's vllm_client module (the trainer's side of its weight sync), loaded from
    the installed TRL without running trl.generation's __init__, which imports accelerate,
    transformers and vLLM's whole engine; of transformers it uses is_torch_xpu_available
    only, which a stand-in gives where transformers is not installed."""
    import importlib.util
    import types

    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.modules["transformers"] = types.SimpleNamespace(is_torch_xpu_available=lambda: False)
    trl = pytest.importorskip("trl")
    where = os.path.join(os.path.dirname(trl.__file__), "generation")
    package = types.ModuleType("trl.generation")
    package.__path__ = [where]
    sys.modules["trl.generation"] = package
    spec = importlib.util.spec_from_file_location("trl.generation.vllm_client",
                                                  os.path.join(where, "vllm_client.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ install()


def made_by_vllms_name(rank, size, port):
    """vLLM's StatelessProcessGroup, its create and its constructor, after install()."""
    import ctrlcomm
    import ctrlcomm.vllm

    assert ctrlcomm.vllm.install()
    from vllm.distributed.utils import StatelessProcessGroup

    pg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank, world_size=size)
    ours = ctrlcomm.StatelessProcessGroup.create("127.0.0.1", port + 1, rank, size)
    out = [isinstance(g, StatelessProcessGroup) and isinstance(g, ctrlcomm.StatelessProcessGroup)
           for g in (pg, ours)]
    out.append(pg.all_gather_obj(rank))
    out.append(pg.broadcast_obj("from 0" if rank == 0 else None, src=0))
    # the constructor, as vLLM's elastic EP makes one through a store of torch's
    import torch.distributed as dist

    sub = StatelessProcessGroup(rank=rank, world_size=size, store=dist.PrefixStore("ep", pg.store))
    out.append((type(sub) is type(pg), sub.all_gather_obj(rank * 10)))
    out.append(len({pg, ours, sub}))  # (hashable, and equal only to itself)
    for g in (sub, ours, pg):
        g.barrier()
        g.close()
    return out


def test_vllms_name_makes_ctrlcomms_group_after_install():
    port = free_port()
    res = run_ranks(made_by_vllms_name, 3, port, timeout=90)
    for out in res:
        assert out == [True, True, [0, 1, 2], "from 0", (True, [0, 10, 20]), 3], out


def test_the_environment_installs_it_in_every_process_started_with_it():
    code = textwrap.dedent("""
        import sys
        assert "vllm.distributed.utils" not in sys.modules  # (not imported by install())
        from vllm.distributed.utils import StatelessProcessGroup
        print(StatelessProcessGroup.create.__module__)
    """)
    for env, expect in (("1", "ctrlcomm._vllm"), ("0", "vllm.distributed.utils")):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "CTRLCOMM_VLLM": env})
        assert p.returncode == 0 and p.stdout.split()[-1] == expect, (env, p.stdout, p.stderr)


# ------------------------------------------------------------------ vLLM's consumers


def message_queue(rank, size, port, n):
    """vLLM's shared-memory broadcast queue, made through the group."""
    import ctrlcomm.vllm

    ctrlcomm.vllm.install()
    import numpy as np
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.distributed.utils import StatelessProcessGroup

    pg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank, world_size=size)
    mq = MessageQueue.create_from_process_group(pg, 1 << 20, 4, writer_rank=0)  # (and ready)
    if rank == 0:
        for i in range(n):
            mq.enqueue((i, np.full(16, i)))
        got = None
    else:
        got = [mq.dequeue() for _ in range(n)]
        got = all(i == j and (a == i).all() for i, (j, a) in enumerate(got))
    pg.barrier()
    pg.close()
    return got


def test_vllms_message_queue_forms_over_the_group():
    res = run_ranks(message_queue, 3, free_port(), 2000, timeout=120)
    assert res == [None, True, True], res


def pynccl_construction(rank, size, port):
    """vLLM's PyNcclCommunicator, made over the group up to the step that needs a GPU."""
    import ctrlcomm.vllm

    ctrlcomm.vllm.install()
    from vllm.distributed.utils import StatelessProcessGroup

    communicator = stand_in_nccl()
    pg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank, world_size=size)
    comm = communicator(pg, device="cpu")
    [(world, uid, r)] = comm.nccl.inits
    ids = pg.all_gather_obj(uid)
    pg.close()
    return (comm.rank, comm.world_size, comm.available, world, r), len(set(ids)), any(uid)


@pytest.mark.parametrize("size", [2, 3])
def test_vllms_pynccl_communicator_takes_the_group(size):
    res = run_ranks(pynccl_construction, size, free_port(), timeout=90)
    for r, (attrs, distinct, nonzero) in enumerate(res):
        assert attrs == (r, size, True, size, r) and distinct == 1 and nonzero, res


# ------------------------------------------------------------------ TRL's weight sync


def trl_server_worker(rank, http_port, commands, results):
    """A stand-in for TRL's vLLM server (trl/scripts/vllm_serve.py): rank 0 answers its
    HTTP routes and hands each request to every worker, as its collective_rpc does; each
    worker runs what TRL's WeightSyncWorkerExtension runs (StatelessProcessGroup.create,
    PyNcclCommunicator, the broadcast then group.barrier() per parameter, del)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import torch

    import ctrlcomm.vllm

    ctrlcomm.vllm.install()
    from vllm.distributed.utils import StatelessProcessGroup

    communicator = stand_in_nccl()
    workers = len(commands)
    server = None
    if rank == 0:
        class Routes(BaseHTTPRequestHandler):
            def reply(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self.reply({"world_size": workers} if "get_world_size" in self.path
                           else {"status": "ok"})

            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                args = json.loads(self.rfile.read(n) or b"{}")
                for q in commands:
                    q.put((self.path.strip("/"), args))
                self.reply({"message": "ok"})

            def log_message(self, *a):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", http_port), Routes)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        results.put(("up", None))
    comm, log = None, []
    while True:
        route, args = commands[rank].get(timeout=90)
        if route == "init_communicator":
            pg = StatelessProcessGroup.create(host=args["host"], port=args["port"], rank=rank,
                                              world_size=args["world_size"])
            comm = communicator(pg, device="cpu")
            client_rank = args["world_size"] - 1
            log.append(("init", bytes(comm.unique_id.internal)))
        elif route == "update_named_param":
            weight = torch.empty(args["shape"], dtype=getattr(torch, args["dtype"].split(".")[-1]))
            comm.broadcast(weight, src=client_rank)
            comm.group.barrier()
            log.append(("update", args["name"], comm.moved[-1]))
        elif route == "close_communicator":
            del comm  # (as TRL's: the group goes with it, closed as it is collected)
            comm = None
            log.append(("close",))
        elif route == "stop":
            break
    if server is not None:
        server.shutdown()
    return log


def trl_client(http_port, group_port, sessions):
    """TRL's trainer side, unchanged: VLLMClient's init_communicator, update_named_param
    and close_communicator, ``sessions`` times over one group port."""
    import types

    import torch

    import ctrlcomm.vllm

    ctrlcomm.vllm.install()
    stand_in_nccl()
    # (CUDA's device query, which TRL asks for the trainer's GPU's uuid)
    torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(uuid="stand-in")
    client_module = trl_vllm_client()
    client = client_module.VLLMClient(base_url=f"http://127.0.0.1:{http_port}",
                                      group_port=group_port, connection_timeout=60)
    log = []
    for s in range(sessions):
        client.init_communicator(device="cpu")
        log.append(("init", bytes(client.communicator.unique_id.internal),
                    type(client.communicator.group).__module__))
        for name, w in (("a.weight", torch.ones(2, 3)), ("b.bias", torch.zeros(4) + s)):
            client.update_named_param(name, w)
            log.append(("update", name, client.communicator.moved[-1]))
        client.close_communicator()
        log.append(("close",))
    return log


def trl_weight_sync(rank, size, http_port, group_port, sessions, commands, results):
    import time

    if rank < size - 1:
        return trl_server_worker(rank, http_port, commands, results)
    assert results.get(timeout=60) == ("up", None)
    if size > 2:
        time.sleep(0.5)  # (the trainer comes late: the workers' create waits for it)
    try:
        return trl_client(http_port, group_port, sessions)
    finally:
        for q in commands:
            q.put(("stop", {}))


@pytest.mark.slow
@pytest.mark.parametrize(("workers", "sessions"), [(1, 1), (2, 2)])
def test_trls_weight_sync_runs_over_the_group(workers, sessions):
    import multiprocessing

    pytest.importorskip("trl")
    with multiprocessing.get_context("spawn").Manager() as manager:
        commands = [manager.Queue() for _ in range(workers)]
        results = manager.Queue()
        res = run_ranks(trl_weight_sync, workers + 1, free_port(), free_port(), sessions,
                        commands, results, timeout=100)
    client, servers = res[-1], res[:-1]
    inits = [e for e in client if e[0] == "init"]
    assert len(inits) == sessions and all(m == "ctrlcomm.vllm" for _, _, m in inits), client
    expected_updates = [("a.weight", ((2, 3), "torch.float32", workers)),
                        ("b.bias", ((4,), "torch.float32", workers))]
    for s in range(sessions):
        assert [e[1:] for e in client if e[0] == "update"][2 * s:2 * s + 2] == expected_updates
    for log in servers:
        # every worker had the client's NCCL id, took each parameter and closed, per session
        assert [e[1] for e in log if e[0] == "init"] == [uid for _, uid, _ in inits], log
        assert [e[1:] for e in log if e[0] == "update"] == expected_updates * sessions, log
        assert sum(e[0] == "close" for e in log) == sessions, log
