"""NCCL started through ctrlcomm groups, as engines start it (needs CUDA GPUs).

Engines start NCCL over groups of their own in two ways, both checked here with real ranks:
- vLLM's ``PyNcclCommunicator``: rank 0 makes an NCCL unique id, ``broadcast_obj`` of a
  ``StatelessProcessGroup`` carries it (a ctypes structure, pickled) to the other ranks, and
  each passes it to ``ncclCommInitRank``;
- :func:`ctrlcomm.torch.init_torch_process_group` with ``backend="nccl"``.

Skipped where torch or CUDA is missing (CI has no GPU). On a GPU machine:
``python -m pytest tests/gpu``.
"""

import ctypes
import glob
import os

import pytest

from ctrlcomm.testing import free_port, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.torch]


def gpu_count():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.cuda.device_count()


# ------------------------------------------------------------------ NCCL through ctypes


class ncclUniqueId(ctypes.Structure):  # noqa: N801 - NCCL's name, as vLLM spells it
    _fields_ = [("internal", ctypes.c_byte * 128)]


def nccl_library():
    """libnccl as vLLM's wrapper loads it: the one torch's CUDA libraries loaded, or the
    ``nvidia-nccl`` wheel's."""
    import torch

    here = os.path.dirname(torch.__file__)
    names = ["libnccl.so.2", *glob.glob(os.path.join(here, "..", "nvidia", "*", "lib", "libnccl.so*")),
             *glob.glob(os.path.join(here, "lib", "libnccl.so*"))]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise OSError(f"no NCCL library found (tried {names})")
    c = ctypes
    lib.ncclGetUniqueId.argtypes = [c.POINTER(ncclUniqueId)]
    lib.ncclCommInitRank.argtypes = [c.POINTER(c.c_void_p), c.c_int, ncclUniqueId, c.c_int]
    lib.ncclAllReduce.argtypes = [c.c_void_p, c.c_void_p, c.c_size_t, c.c_int, c.c_int,
                                  c.c_void_p, c.c_void_p]
    lib.ncclCommDestroy.argtypes = [c.c_void_p]
    lib.ncclGetErrorString.argtypes = [c.c_int]
    lib.ncclGetErrorString.restype = c.c_char_p
    lib.ncclGetLastError.argtypes = [c.c_void_p]
    lib.ncclGetLastError.restype = c.c_char_p
    return lib


NCCL_FLOAT32, NCCL_SUM, NCCL_INVALID_USAGE = 7, 0, 5


def nccl_through_stateless_group(rank, size, port, gpus):
    import torch

    from ctrlcomm import StatelessProcessGroup

    lib = nccl_library()
    torch.cuda.set_device(rank % gpus)
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, size)
    uid = None
    if rank == 0:
        uid = ncclUniqueId()
        assert lib.ncclGetUniqueId(ctypes.byref(uid)) == 0
    uid = pg.broadcast_obj(uid, src=0)  # as vLLM's PyNcclCommunicator does
    out = {"type": type(uid).__name__, "uid": bytes(uid.internal)}
    comm = ctypes.c_void_p()
    res = lib.ncclCommInitRank(ctypes.byref(comm), size, uid, rank)
    out["init"] = res
    if res != 0:
        out["error"] = f"{lib.ncclGetErrorString(res).decode()}: " \
                       f"{(lib.ncclGetLastError(None) or b'').decode()}"
    else:
        t = torch.full((1000,), float(rank + 1), device="cuda")
        stream = torch.cuda.current_stream()
        out["all_reduce"] = lib.ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), NCCL_FLOAT32,
                                              NCCL_SUM, comm, stream.cuda_stream)
        stream.synchronize()
        out["sum"] = sorted(set(t.tolist()))
        lib.ncclCommDestroy(comm)
    # the group goes on working beside NCCL
    out["after"] = pg.all_gather_obj(rank)
    pg.barrier()
    pg.close()
    return out


def check_shared_id(res, size):
    for r, out in enumerate(res):
        assert out["type"] == "ncclUniqueId", (r, out)
        assert out["uid"] == res[0]["uid"] and any(res[0]["uid"]), (r, out)
        assert out["after"] == list(range(size)), (r, out)


def test_nccl_unique_id_through_broadcast_obj_starts_nccl_on_every_gpu():
    gpus = gpu_count()
    size = min(gpus, 8)
    res = run_ranks(nccl_through_stateless_group, size, free_port(), gpus, timeout=100)
    check_shared_id(res, size)
    for r, out in enumerate(res):
        assert out["init"] == 0 and out["all_reduce"] == 0, (r, out)
        assert out["sum"] == [size * (size + 1) / 2], (r, out)


def test_two_ranks_meet_in_nccl_through_a_unique_id_from_broadcast_obj():
    """Two ranks, on two GPUs where there are two: they all-reduce. On one GPU, NCCL refuses
    two ranks on a device, which it can only see once both ranks have met through the id."""
    gpus = gpu_count()
    res = run_ranks(nccl_through_stateless_group, 2, free_port(), gpus, timeout=100)
    check_shared_id(res, 2)
    for r, out in enumerate(res):
        if gpus >= 2:
            assert out["init"] == 0 and out["sum"] == [3.0], (r, out)
        else:
            assert out["init"] == NCCL_INVALID_USAGE, (r, out)
            assert "Duplicate GPU detected" in out["error"], (r, out)
            assert f"rank {1 - r}" in out["error"], (r, out)


# --------------------------------------------------------------- torch's ProcessGroupNCCL


def torch_nccl(rank, size, port):
    import torch
    import torch.distributed as dist

    from ctrlcomm import Group
    from ctrlcomm.torch import init_torch_process_group

    torch.cuda.set_device(rank)
    g = Group.create("127.0.0.1", port, rank, size, name="nccl")
    pg = init_torch_process_group(g, backend="nccl", timeout=60)
    t = torch.tensor([rank + 1.0, 2.0], device="cuda")
    pg.allreduce([t]).wait()
    u = torch.tensor([10 * (rank + 1)], device="cuda")
    dist.all_reduce(u, group=pg)
    b = torch.tensor([rank + 100], device="cuda")
    pg.broadcast(b, size - 1).wait()
    torch.cuda.synchronize()
    out = {"pg": t.tolist(), "dist": u.tolist(), "broadcast": b.tolist(),
           "initialized": dist.is_initialized(), "after": g.all_gather(rank)}
    if hasattr(pg, "shutdown"):
        pg.shutdown()
    g.close()
    return out


def test_init_torch_process_group_nccl():
    gpus = gpu_count()
    size = min(gpus, 4)
    res = run_ranks(torch_nccl, size, free_port(), timeout=100)
    for r, out in enumerate(res):
        assert out["pg"] == [size * (size + 1) / 2, 2.0 * size], (r, out)
        assert out["dist"] == [10 * size * (size + 1) // 2], (r, out)
        assert out["broadcast"] == [size - 1 + 100], (r, out)
        assert out["initialized"] is False, (r, out)
        assert out["after"] == list(range(size)), (r, out)
