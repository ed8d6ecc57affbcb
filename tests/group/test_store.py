"""The rendezvous store over real sockets: client calls, deadlines, the CLI."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import ctrlcomm
from ctrlcomm.testing import free_port, run_ranks


def test_client_calls(store):
    c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5, prefix="ns/")
    c.set("a", "1")
    assert c.get("a") == b"1"
    assert c.add("n", 3) == 3 and c.add("n", -1) == 2
    assert c.compare_set("k", None, "v1") == b"v1"
    assert c.compare_set("k", "wrong", "v2") == b"v1"
    assert c.compare_set("k", "v1", "v2") == b"v2"
    assert c.set_if_absent("k", "zz") == (False, b"v2")
    assert c.check(["a", "k"]) and not c.check(["a", "nope"])
    assert c.delete_key("a") and not c.delete("a")
    with pytest.raises(KeyError) as e:
        c.get("a", wait=False)
    # (a KeyError, as TCPStore's users expect, and a StoreError: every error ctrlcomm
    # raises derives from CtrlcommError)
    assert isinstance(e.value, ctrlcomm.StoreError)
    other = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5, prefix="other/")
    with pytest.raises(KeyError):
        other.get("k", wait=False)  # namespaced: another prefix sees nothing
    other.close()
    c.close()


def test_torch_store_methods_and_timedeltas(store):
    """What code written for torch's TCPStore calls on ``pg.store``: timeouts as timedeltas,
    set_timeout, multi_set, append."""
    from datetime import timedelta

    c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5, prefix="t/")
    c.set("a", "1")
    c.wait(["a"], timedelta(seconds=1))
    c.wait(["a"], timeout=timedelta(milliseconds=500))
    with pytest.raises(ctrlcomm.StoreTimeoutError, match=r"\['b'\]"):
        c.wait(["a", "b"], timedelta(milliseconds=300))
    assert c.get("a", timeout=timedelta(seconds=1)) == b"1"
    c.set_timeout(timedelta(seconds=7))
    assert c.timeout == 7.0
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="timeout"):
        c.set_timeout("soon")
    c.multi_set(["x", "y"], ["1", b"2"])
    assert c.multi_get(["x", "y"]) == [b"1", b"2"]
    with pytest.raises(ctrlcomm.InvalidArgumentError):
        c.multi_set(["x"], [])
    c.append("log", "ab")  # absent: set
    c.append("log", b"cd")
    c.set("empty", b"")
    c.append("empty", "z")
    assert c.get("log") == b"abcd" and c.get("empty") == b"z"

    def appender(i, same):
        with ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5, prefix="t/") as d:
            for _ in range(50):
                d.append("same" if same else "many", "a" if same else str(i))

    for same in (False, True):  # (the same bytes from each: no append taken for another's)
        threads = [threading.Thread(target=appender, args=(i, same)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert sorted(c.get("many").decode()) == sorted("0123" * 50)  # none lost
    assert c.get("same") == b"a" * 200
    c.close()


def test_compare_set_answers_as_torchs_tcpstore(store):
    # the same sequence on torch's TCPStore and on ctrlcomm's client, answer for answer (a
    # missing key with a non-empty expected value answered b"" where TCPStore answers the
    # expected value)
    from datetime import timedelta

    dist = pytest.importorskip("torch.distributed")
    ours = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5, prefix="cs/")
    theirs = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=5))
    steps = [("a", "exp", "d"), ("a", "", "new"), ("a", "zzz", "other"), ("a", "new", "n2"),
             ("b", "", ""), ("b", "", "x"), ("c", b"\x00", b"\xff"), ("a", "n2", "")]
    want = [theirs.compare_set(*step) for step in steps]
    assert [ours.compare_set(*step) for step in steps] == want
    assert want[:4] == [b"exp", b"new", b"new", b"n2"]  # (what the comparison rests on)
    ours.close()


def test_queues_push_pop_len_as_tcpstores(store):
    """``pg.store.queue_push/queue_pop/queue_len``, as code written for TCPStore calls them:
    first in, first out, per prefix, apart from the keys; a pop of an empty queue waits
    for a push (each value to one pop), or says it is empty at once without ``block``."""
    a = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5, prefix="qa/")
    b = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5, prefix="qb/")
    keys = a.num_keys()
    assert a.queue_len("jobs") == 0
    a.queue_push("jobs", "one")
    a.queue_push("jobs", b"\x00two")
    b.queue_push("jobs", "other")
    assert a.queue_len("jobs") == 2 and b.queue_len("jobs") == 1
    assert a.num_keys() == keys and "jobs" not in a.list_keys()  # (queues are not keys)
    assert a.check(["jobs"]) and not b.check(["nothing"])  # (but seen, as by TCPStore's)
    assert a.queue_pop("jobs") == b"one" and a.queue_pop("jobs", False) == b"\x00two"
    with pytest.raises(ctrlcomm.StoreQueueEmptyError, match="queue 'jobs' is empty"):
        a.queue_pop("jobs", block=False)
    t = time.monotonic()
    with pytest.raises(ctrlcomm.StoreTimeoutError, match="queue_pop of 'jobs' timed out"):
        a.queue_pop("jobs", timeout=0.3)
    assert 0.25 < time.monotonic() - t < 3.0
    a.queue_push("jobs", "after")  # (the pop that timed out took nothing)
    assert a.queue_pop("jobs") == b"after" and b.queue_pop("jobs") == b"other"

    # consumers parked in threads, each on its own connection: every value once; a
    # timed-out pop loses nothing
    got, clients = [], []

    def consume():
        c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=10, prefix="qa/")
        clients.append(c)
        got.append(c.queue_pop("work"))

    threads = [threading.Thread(target=consume) for _ in range(3)]
    for th in threads:
        th.start()
    _parked_pops(store, 3, 5.0)
    for i in range(4):
        a.queue_push("work", f"w{i}")
    for th in threads:
        th.join(15)
    assert sorted(got) == [b"w0", b"w1", b"w2"] and a.queue_len("work") == 1
    assert a.queue_pop("work") == b"w3"
    for c in (a, b, *clients):
        c.close()
    with pytest.raises(ctrlcomm.StoreError, match="closed"):
        a.queue_len("jobs")

    dist = pytest.importorskip("torch.distributed")  # the same answers from TCPStore's
    from datetime import timedelta

    theirs = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=5))
    ours = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5, prefix="qt/")
    answers = []
    for s in (theirs, ours):
        seen = [s.check(["q"])]
        s.queue_push("q", "x")
        s.queue_push("q", b"y")
        s.wait(["q"], timedelta(seconds=5))  # (returns: the queue holds values)
        seen += [s.check(["q"]), s.get("q")]
        answers.append((s.queue_len("q"), s.queue_pop("q"), s.queue_pop("q", block=False),
                        s.queue_len("q"), s.queue_len("never")))
        s.set("kq", "v")  # (a key and a queue of one name: apart)
        s.queue_push("kq", "w")
        seen += [s.check(["q"]), s.get("kq"), s.queue_pop("kq"), s.get("kq"),
                 s.delete_key("kq"), s.check(["kq"])]
        answers.append(seen)
    assert answers[0] == answers[2] == (2, b"x", b"y", 0, 0)
    assert answers[1] == answers[3] == [False, True, b"", False, b"v", b"w", b"v", True,
                                        False], answers
    for s, empty in ((theirs, dist.QueueEmptyError), (ours, ctrlcomm.StoreQueueEmptyError)):
        with pytest.raises(empty):
            s.queue_pop("q", block=False)
    ours.close()


def _parked_pops(store, n, deadline_s=10.0):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:  # (the server's thread changes its state meanwhile)
            if store.state.n_poppers() >= n:
                return True
        except RuntimeError:
            pass
        time.sleep(0.01)
    return False


def test_a_value_pushed_while_a_pop_waits_whose_caller_is_gone_stays_queued(store):
    """(Before: a push handed its value to the first pop parked, and it was lost where that
    pop's caller had gone: TCPStore keeps it queued for the next pop.)"""
    port = store.port
    c = ctrlcomm.StoreClient("127.0.0.1", port, timeout=10, prefix="gone/")
    # a process parked in a pop, killed
    code = (f"import ctrlcomm; c = ctrlcomm.StoreClient('127.0.0.1', {port}, timeout=60, "
            "prefix='gone/'); c.queue_pop('q')")
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert _parked_pops(store, 1, 30), "the child's pop never parked"
    finally:
        p.kill()
        p.wait(10)
    c.queue_push("q", "precious")
    assert c.queue_len("q") == 1 and c.queue_pop("q", block=False) == b"precious"

    # a pop whose client is closed from another thread while it waits
    waiter = ctrlcomm.StoreClient("127.0.0.1", port, timeout=10, prefix="gone/")
    raised = []

    def pop():
        try:
            waiter.queue_pop("q", timeout=30)
        except ctrlcomm.StoreError as e:
            raised.append(e)

    th = threading.Thread(target=pop)
    th.start()
    assert _parked_pops(store, 1)
    waiter.close()
    th.join(10)
    assert raised and not th.is_alive(), raised
    c.queue_push("q", "kept")
    assert c.queue_len("q") == 1 and c.queue_pop("q") == b"kept"

    # a pop that timed out on its client while the store still held it
    late = ctrlcomm.StoreClient("127.0.0.1", port, timeout=10, prefix="gone/")
    with pytest.raises(ctrlcomm.StoreTimeoutError):
        late.queue_pop("q", timeout=0.2)
    c.queue_push("q", "again")  # (the pop may still be parked at the store: it is woken)
    assert late.queue_pop("q", timeout=5) == b"again" and c.queue_len("q") == 0

    # two pops waiting, two pushes: each value to one of them, none left, none lost
    got = []
    clients = [ctrlcomm.StoreClient("127.0.0.1", port, timeout=10, prefix="gone/")
               for _ in range(2)]
    threads = [threading.Thread(target=lambda cl=cl: got.append(cl.queue_pop("w")))
               for cl in clients]
    for th in threads:
        th.start()
    assert _parked_pops(store, 2)
    c.queue_push("w", "1")
    c.queue_push("w", "2")
    for th in threads:
        th.join(10)
    assert sorted(got) == [b"1", b"2"] and c.queue_len("w") == 0
    for cl in (c, late, *clients):
        cl.close()


def test_num_keys_and_list_keys_answer_as_tcpstores(store):
    """``pg.store.num_keys()`` and ``list_keys()``, as code written for TCPStore calls them:
    the count is of every key (a prefix does not narrow it, as with torch's PrefixStore);
    the list is of this client's keys, without its prefix."""
    a = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5, prefix="nk/")
    b = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5, prefix="nk-other/")
    base = a.num_keys()
    assert isinstance(base, int) and base >= 0 and sorted(a.list_keys()) == []
    a.set("x", "1")
    a.add("n", 2)
    a.set("caf\u00e9/\u4e2d", b"")  # (a key that is not ASCII comes back as given)
    b.set("x", "2")
    assert a.num_keys() == b.num_keys() == base + 4
    assert sorted(a.list_keys()) == sorted(["x", "n", "caf\u00e9/\u4e2d"])
    assert b.list_keys() == ["x"]
    assert a.delete_key("x")
    assert a.num_keys() == base + 3 and "x" not in a.list_keys()
    whole = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5)
    assert {"nk/n", "nk-other/x"} <= set(whole.list_keys())
    assert len(whole.list_keys()) == whole.num_keys()
    for c in (a, b, whole):
        c.close()
    with pytest.raises(ctrlcomm.StoreError, match="closed"):
        a.num_keys()

    dist = pytest.importorskip("torch.distributed")  # the same answers from TCPStore's
    from datetime import timedelta

    theirs = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=5))
    ours = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5, prefix="nk3/")
    for s in (theirs, ours):
        s.set("p", "1")
        s.add("q", 1)
    assert sorted(ours.list_keys()) == sorted(k for k in theirs.list_keys() if k in "pq")
    assert isinstance(theirs.num_keys(), int) and isinstance(ours.num_keys(), int)
    ours.close()


def vllm_store_keys(rank, size, port):
    from ctrlcomm import StatelessProcessGroup

    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, size)
    pg.store.set(f"mine/{rank}", str(rank))
    pg.barrier()
    keys = sorted(k for k in pg.store.list_keys() if k.startswith("mine/"))
    n = pg.store.num_keys()
    pg.barrier()
    return keys, n >= size


def test_a_vllm_groups_store_lists_and_counts_its_keys():
    got = run_ranks(vllm_store_keys, 2, free_port(), timeout=60)
    assert got == [(["mine/0", "mine/1"], True)] * 2


def test_get_waits_for_a_later_set(store):
    c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5)

    def later():
        time.sleep(0.3)
        with ctrlcomm.StoreClient("127.0.0.1", store.port) as d:
            d.set("late", b"here")

    threading.Thread(target=later).start()
    t = time.monotonic()
    assert c.get("late", timeout=5) == b"here"
    assert 0.2 < time.monotonic() - t < 3
    c.wait(["late"], timeout=1)
    c.close()


def test_deadlines_name_the_missing_keys(store):
    c = ctrlcomm.StoreClient("127.0.0.1", store.port)
    t = time.monotonic()
    with pytest.raises(ctrlcomm.StoreTimeoutError, match="never"):
        c.get("never", timeout=0.5)
    c.set("a", "x")
    with pytest.raises(ctrlcomm.StoreTimeoutError, match=r"\['b'\]"):
        c.wait(["a", "b"], timeout=0.5)
    assert time.monotonic() - t < 3
    c.close()


def test_unreachable_store_times_out():
    c = ctrlcomm.StoreClient("127.0.0.1", free_port(), timeout=0.5)
    t = time.monotonic()
    with pytest.raises(ctrlcomm.StoreTimeoutError, match="did not answer"):
        c.set("a", "b")
    assert time.monotonic() - t < 2
    c.close()


def test_store_refusal_is_a_store_error(store):
    c = ctrlcomm.StoreClient("127.0.0.1", store.port)
    c.set("n", "not a number")
    with pytest.raises(ctrlcomm.StoreError, match="integer"):
        c.add("n", 1)
    c.close()


def test_add_is_64_bit_and_wraps_as_tcpstores_and_the_store_serves_on(store):
    c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5)
    assert c.add("w", 2**63 - 1) == 2**63 - 1
    assert c.add("w", 1) == -(2**63)  # wraps, as TCPStore's int64
    assert c.add("w", -1) == 2**63 - 1
    # a value of 4,301 digits: its sum had more digits than int() may write, and the
    # ValueError ended the store's thread: no request of anyone was answered after it
    c.set("big", "9" * 4300)
    with pytest.raises(ctrlcomm.StoreError, match="64-bit"):
        c.add("big", 1)
    c.set("big", str(2**63))
    with pytest.raises(ctrlcomm.StoreError, match="64-bit"):
        c.add("big", 1)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="64-bit"):
        c.add("n", 2**64)
    assert c.add("n", 5) == 5  # still serving
    c.close()


def test_a_value_that_is_not_str_or_bytes_is_refused_as_by_tcpstore(store):
    # (before: bytes(3), three zero bytes, were stored for the int 3)
    c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5)
    for bad in (3, 2.5, None, ["a"]):
        with pytest.raises(TypeError, match=type(bad).__name__) as e:
            c.set("k", bad)
        assert isinstance(e.value, ctrlcomm.InvalidArgumentError)  # (and a CtrlcommError)
    with pytest.raises(TypeError):
        c.compare_set("k", "", 3)
    c.set("k", bytearray(b"ok"))
    assert c.get("k") == b"ok" and c.check(["k"])
    c.close()


def test_a_str_where_keys_are_listed_is_refused_not_split_into_characters(store):
    """(before: check("ready") looked for "r", "e", "a", "d", "y": False while "ready" was
    set, True once it was deleted; wait("go") waited for "g" and "o")"""
    c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5)
    c.set("ready", "1")
    for call in (lambda: c.check("ready"), lambda: c.wait("ready"),
                 lambda: c.exists("ready"), lambda: c.multi_get("ready"),
                 lambda: c.multi_delete("ready"), lambda: c.check(b"ready")):
        with pytest.raises(TypeError, match="a list of keys.*'ready'") as e:
            call()
        assert isinstance(e.value, ctrlcomm.InvalidArgumentError)
    assert c.check(["ready"]) and c.get("ready") == b"1"  # (nothing deleted)
    c.close()


def test_add_takes_an_int_only_as_tcpstores(store):
    """(before: add("f", 1.5) added 1, add("s", "7") added 7, "abc" a bare ValueError)"""
    import numpy as np

    c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5)
    for bad in (1.5, "7", "abc", None, b"1"):
        with pytest.raises(TypeError, match=f"add of 'k': the amount must be an int.*"
                                            f"{type(bad).__name__}"):
            c.add("k", bad)
    assert c.add("k", True) == 1 and c.add("k", np.int64(2)) == 3
    c.close()


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), "soon"])
def test_bad_store_timeouts_are_invalid_arguments(store, bad):
    """(before: -1 or 0 gave "store did not answer within 0.0 s (is it running?" from a
    running store; NaN a bare ValueError)"""
    from datetime import timedelta

    c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5)
    for call in (lambda: c.get("k", timeout=bad), lambda: c.set("k", "v", timeout=bad),
                 lambda: c.wait(["k"], timeout=bad), lambda: c.set_timeout(bad),
                 lambda: ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=bad)):
        with pytest.raises(ctrlcomm.InvalidArgumentError, match="timeout"):
            call()
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="timeout must be > 0"):
        c.get("k", timeout=timedelta(seconds=-1))
    c.set("k", "v", timeout=timedelta(seconds=2))
    assert c.get("k", timeout=float("inf")) == b"v"
    c.close()


@pytest.mark.parametrize("port", ["x", 70000, 0, 2.5])
def test_a_bad_store_port_is_an_invalid_argument(port):
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="port"):
        ctrlcomm.StoreClient("127.0.0.1", port)


def test_a_closed_store_client_says_so(store):
    """(before: zmq's own "Socket operation on non-socket"; and close() from another thread
    closed the socket under a waiting get)"""
    c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=30)
    c.close()
    c.close()
    with pytest.raises(ctrlcomm.StoreError, match="client of 127.0.0.1:.* is closed"):
        c.get("k")
    c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=30)
    got = []

    def waits():
        try:
            c.get("never")
        except BaseException as e:  # noqa: BLE001
            got.append(e)

    t = threading.Thread(target=waits)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    c.close()  # (does not wait for the get)
    assert time.monotonic() - t0 < 0.1
    t.join(5)
    assert not t.is_alive() and len(got) == 1, got
    assert isinstance(got[0], ctrlcomm.StoreError) and "closed" in str(got[0]), got
    with pytest.raises(ctrlcomm.StoreError, match="closed"):
        c.set("k", "v")


def test_a_close_from_another_thread_as_a_call_ends_closes_the_connection(store):
    """The call's end and the close meet (a thread switch between the call's last look at
    the client and its release of the client's lock, widened here to 0.2 s). (Before: the
    close only woke the call, which had looked already: the socket and the wake-up pipe
    stayed open for good.)"""
    class SlowRelease:
        def __init__(self):
            self.lock = threading.Lock()

        def acquire(self, blocking=True, timeout=-1):
            return self.lock.acquire(blocking, timeout)

        def release(self):
            time.sleep(0.2)
            self.lock.release()

        def __enter__(self):
            self.lock.acquire()
            return self

        def __exit__(self, *exc):
            self.release()

    for _ in range(3):
        c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5)
        c._lock = SlowRelease()
        t = threading.Thread(target=c.ping)
        t.start()
        time.sleep(0.1)
        c.close()
        t.join(5)
        assert c._conn._bell_w < 0, "the connection was left open"


def test_a_store_timeout_names_the_store(store):
    c = ctrlcomm.StoreClient("127.0.0.1", store.port)
    with pytest.raises(ctrlcomm.StoreTimeoutError, match=f"store at 127.0.0.1:{store.port}: "
                                                         "get timed out.*never"):
        c.get("never", timeout=0.2)
    with pytest.raises(ctrlcomm.StoreTimeoutError, match=f"127.0.0.1:{store.port}: wait"):
        c.wait(["never"], timeout=0.2)
    c.close()


@pytest.fixture
def dns(monkeypatch):
    """This process's resolver, with names under ``.invalid`` unknown (NXDOMAIN) at once and
    ``slow.example`` answered (as localhost) only once ``dns.answer`` is set: the tests do
    not hang on the machine's DNS. (Real DNS servers, silent ones included:
    tests/multihost/test_dns.py.)"""
    import socket

    real = socket.getaddrinfo
    answer = threading.Event()
    calls = []

    def getaddrinfo(host, *args, **kwargs):
        calls.append(host)
        if isinstance(host, str) and host.endswith(".invalid"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if host == "slow.example":
            answer.wait(30)
            host = "localhost"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    getaddrinfo.answer, getaddrinfo.calls = answer, calls
    yield getaddrinfo
    answer.set()


def test_group_create_on_a_host_that_does_not_resolve_names_it(dns):
    """(before: a bare socket.gaierror naming no host, and on rank 0 "cannot bind store on
    tcp://no.such.host.invalid:P: No such device")"""
    for rank in (0, 1):
        with pytest.raises(ctrlcomm.StoreError, match="host 'no.such.host.invalid' does not "
                                                      "resolve"):
            ctrlcomm.Group.create("no.such.host.invalid", free_port(), rank, 2, timeout=2)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="host must be"):
        ctrlcomm.Group.create(None, free_port(), 0, 1)
    with ctrlcomm.Group.create("[::1]", free_port(), 0, 1, timeout=5) as g:  # (as in a URL)
        assert g.all_reduce(3) == 3


def test_a_store_client_on_a_host_that_does_not_resolve_names_it(dns):
    """(before: the client was made, ZeroMQ kept the name, and its first request said only
    that the store "did not answer within 2.0 s ... is it running?")"""
    with pytest.raises(ctrlcomm.StoreError, match="host 'no.such.host.invalid' does not "
                                                  "resolve") as e:
        ctrlcomm.StoreClient("no.such.host.invalid", free_port(), timeout=2)
    assert not isinstance(e.value, ctrlcomm.StoreTimeoutError)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="store: host must be"):
        ctrlcomm.StoreClient(None, free_port())


def test_a_store_client_given_a_name_talks_to_the_store_at_its_address(store):
    c = ctrlcomm.StoreClient("localhost", store.port, timeout=5)
    try:
        c.set("k", b"v")
        assert c.get("k") == b"v"
        assert "localhost" in repr(c)
        assert c._conn.addr == f"tcp://127.0.0.1:{store.port}"  # (ZeroMQ is given the number)
    finally:
        c.close()


def _waits_in_resolve(thread):
    """Whether ``thread`` waits for a lookup's answer, in resolve."""
    import sys

    f = sys._current_frames().get(thread.ident)
    while f is not None:
        if f.f_code.co_name == "wait" and f.f_back is not None \
                and f.f_back.f_code.co_name == "resolve":
            return True
        f = f.f_back
    return False


def test_a_lookup_where_no_thread_can_start_is_made_in_the_caller(dns, monkeypatch):
    """(before: the name's entry stayed, and every later lookup of it in the process waited
    for a thread that never ran, until its deadline)"""
    import socket

    from ctrlcomm.transport import _net

    start = threading.Thread.start

    def refused(self):
        if self.name.startswith("ctrlcomm-resolve-"):
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refused)
    assert _net.resolve("localhost", 1) == "127.0.0.1"
    with pytest.raises(socket.gaierror, match="not known"):  # (as from the thread)
        _net.resolve("no.such.host.invalid", 1)
    assert not _net._lookups
    monkeypatch.setattr(threading.Thread, "start", start)
    assert _net.resolve("localhost", 1) == "127.0.0.1"


@pytest.mark.parametrize("timeout", [float("inf"), 1e10])
def test_a_name_is_looked_up_under_a_timeout_too_long_for_a_thread_to_wait(timeout):
    """(threading's waits take at most TIMEOUT_MAX, 9.2e9 s here: before, such a timeout
    raised OverflowError wherever the lookup had not returned before the wait began)"""
    from ctrlcomm.transport._net import resolve

    for _ in range(3):
        assert resolve("localhost", timeout) == "127.0.0.1"
        with ctrlcomm.Group.create("localhost", free_port(), 0, 1, timeout=timeout) as g:
            assert g.all_reduce(5) == 5


def test_callers_of_one_name_share_its_lookup_and_each_keeps_its_deadline(dns):
    """A resolver that hangs holds one thread per name, however many tries wait on it."""
    from ctrlcomm.transport._net import resolve

    def lookups():
        return [t for t in threading.enumerate() if t.name == "ctrlcomm-resolve-slow.example"]

    got = []

    def attempt(timeout):
        t = time.monotonic()
        try:
            got.append(resolve("slow.example", timeout))
        except TimeoutError as e:
            got.append((type(e).__name__, str(e), time.monotonic() - t))

    tries = [threading.Thread(target=attempt, args=(0.3,)) for _ in range(4)]
    for th in tries:
        th.start()
    for th in tries:
        th.join(10)
    assert len(got) == 4 and all(g[0] == "TimeoutError" and "'slow.example'" in g[1]
                                 and g[2] < 3 for g in got), got
    with pytest.raises(ctrlcomm.StoreTimeoutError, match="looking up host 'slow.example'"):
        ctrlcomm.StoreClient("slow.example", free_port(), timeout=0.2)
    assert len(lookups()) == 1 and dns.calls.count("slow.example") == 1
    waiter = threading.Thread(target=attempt, args=(20,))
    waiter.start()
    until = time.monotonic() + 10
    while not _waits_in_resolve(waiter) and time.monotonic() < until:
        time.sleep(0.005)
    assert dns.calls.count("slow.example") == 1  # (it waits on the lookup there was)
    dns.answer.set()  # (the lookup returns: the one waiting gets its answer)
    waiter.join(10)
    assert got[-1] == "127.0.0.1"
    assert resolve("slow.example", 5) == "127.0.0.1"  # (a new lookup, answered at once)
    for t in lookups():  # (a lookup's thread ends just after it answers)
        t.join(5)
    assert dns.calls.count("slow.example") == 2 and not lookups()


def _named(rank, size, port):
    with ctrlcomm.Group.create("localhost", port, rank, size, timeout=20,
                               bind_host="localhost" if rank == 1 else None) as g:
        return g.all_gather(g._core.ep.address)


def test_a_group_on_host_names_forms_and_binds_at_their_addresses():
    port = free_port()
    res = run_ranks(_named, 3, port, timeout=60)
    assert res[0] == res[1] == res[2]
    assert all(a.startswith("tcp://127.0.0.1:") for a in res[0]), res[0]


@pytest.mark.parametrize("bind_host", ["no.such.host.invalid", "", None, 7])
def test_a_bind_host_that_is_no_address_is_named(bind_host, dns):
    """(before: a bare socket.gaierror, "Name or service not known", naming nothing)"""
    if bind_host is None:  # (the default: the interface toward the store's host)
        with ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, bind_host=bind_host,
                                   timeout=5) as g:
            assert g.all_reduce(1) == 1
        return
    port = free_port()
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="bind_host"):
        ctrlcomm.Group.create("127.0.0.1", port, 0, 1, bind_host=bind_host, timeout=5)
    with ctrlcomm.Group.create("127.0.0.1", port, 0, 1, timeout=5) as g:  # (nothing left)
        assert g.all_reduce(1) == 1


def test_a_store_server_binds_a_host_name_within_its_lookup_timeout(dns):
    """A name is looked up by the server (ZeroMQ, given it, looks it up in bind() without a
    deadline: seen in strace, a DNS query); an interface's name and numbers go to ZeroMQ as
    they are. (before: slow.example held the constructor until its resolver answered, and a
    name that does not resolve gave "No such device")"""
    with ctrlcomm.StoreServer("localhost", 0) as srv:  # (looked up: 127.0.0.1)
        c = ctrlcomm.StoreClient("127.0.0.1", srv.port, timeout=5)
        c.set("k", b"v")
        assert c.get("k") == b"v"
        c.close()
    assert "localhost" in dns.calls
    names = [n for _, n in socket.if_nameindex()]
    lo = "lo" if "lo" in names else names[0]  # (an interface's name: not looked up)
    ctrlcomm.StoreServer(lo, 0).close()
    assert lo not in dns.calls
    with ctrlcomm.StoreServer("[::1]", 0) as srv:  # (as a URL writes it, as before)
        c = ctrlcomm.StoreClient("::1", srv.port, timeout=5)
        c.set("k", b"v6")
        assert c.get("k") == b"v6"
        c.close()
    t = time.monotonic()
    with pytest.raises(ctrlcomm.StoreTimeoutError, match="slow.example.*took longer than"):
        ctrlcomm.StoreServer("slow.example", 0, lookup_timeout=0.3)
    assert time.monotonic() - t < 3
    with pytest.raises(ctrlcomm.StoreError, match="'no.such.host.invalid' is not an address"):
        ctrlcomm.StoreServer("no.such.host.invalid", 0)
    for bad in ("", None):
        with pytest.raises(ctrlcomm.StoreError, match="host must be a non-empty str"):
            ctrlcomm.StoreServer(bad, 0)
    dns.answer.set()  # (slow.example answers now: localhost, bound)
    ctrlcomm.StoreServer("slow.example", 0).close()


def _wildcards(rank, size, port):
    """Ranks given the store's host as ::, 0.0.0.0 and 127.0.0.1 (one host). Ranks 0 and
    1 in turn sleep twice the liveness timeout while the others wait for them: their
    heartbeats must reach the others (a silent rank that uses no CPU is lost)."""
    host = ("::", "0.0.0.0", "127.0.0.1")[rank]
    with ctrlcomm.Group.create(host, port, rank, size, timeout=20, liveness_timeout=1.0,
                               heartbeat_interval=0.2) as g:
        g.barrier()
        got = []
        for sleeper in (0, 1):
            if rank == sleeper:
                time.sleep(2.0)
            got.append(g.all_gather(rank))
        g.send(rank, dst=(rank + 1) % size)
        return got, g.recv(src=(rank - 1) % size), g._core.ep.address


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_ranks_on_every_interface_of_either_family_reach_each_other(transport, monkeypatch):
    """(before: the rank on :: sent its heartbeats to IPv4 peers in vain, unseen, and was
    declared lost after the idle spell; the rank on 0.0.0.0 was looked for at ::1, where
    nothing listened: "cannot connect to tcp://[::1]:...")"""
    monkeypatch.setenv("CTRLCOMM_TRANSPORT", transport)
    res = run_ranks(_wildcards, 3, free_port(), timeout=60)
    for r, (got, prev, _) in enumerate(res):
        assert got == [[0, 1, 2]] * 2 and prev == (r - 1) % 3
    assert res[0][2].startswith("tcp://[::]:") and res[1][2].startswith("tcp://0.0.0.0:")


def test_a_rank_whose_store_host_rank_0_never_came_gets_a_formation_timeout_naming_it():
    """(before: a StoreTimeoutError only, "store did not answer": code that catches
    FormationTimeoutError missed it)"""
    t = time.monotonic()
    with pytest.raises(ctrlcomm.FormationTimeoutError, match="which rank 0 hosts, answered "
                                                             "nothing") as e:
        ctrlcomm.Group.create("127.0.0.1", free_port(), 1, 2, timeout=1.0)
    assert time.monotonic() - t < 2.5
    assert e.value.missing == [0] and isinstance(e.value, ctrlcomm.StoreTimeoutError)
    with pytest.raises(ctrlcomm.FormationTimeoutError, match="answered nothing .is it running"):
        ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 2, host_store=False, timeout=0.5)


def test_store_command_serves_groups():
    port = free_port()
    with subprocess.Popen([sys.executable, "-m", "ctrlcomm", "store", "--host", "127.0.0.1",
                           "--port", str(port)], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert f"127.0.0.1:{port}" in proc.stdout.readline()
            with ctrlcomm.Group.create("127.0.0.1", port, 0, 1, host_store=False,
                                       timeout=10) as g:
                assert g.all_reduce(5) == 5
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=10) == 0


def test_port_in_use_for_store_server():
    srv = ctrlcomm.StoreServer("127.0.0.1", 0)
    try:
        with pytest.raises(ctrlcomm.StoreError, match=f"127.0.0.1:{srv.port}.*already in use"):
            ctrlcomm.StoreServer("127.0.0.1", srv.port)
    finally:
        srv.close()

    # the command says so in one line, not a traceback
    srv = ctrlcomm.StoreServer("127.0.0.1", 0)
    try:
        p = subprocess.run([sys.executable, "-m", "ctrlcomm", "store", "--port", str(srv.port)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 1 and f"127.0.0.1:{srv.port}" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr, p.stderr
    finally:
        srv.close()


def test_a_wait_with_a_deadline_days_away_leaves_the_store_serving(store):
    # (ZeroMQ polls take milliseconds as a C int: 2**31 ms is under 25 days)
    waiter = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5)
    t = threading.Thread(target=lambda: _swallow(lambda: waiter.get("never", timeout=1e9)),
                         daemon=True)
    t.start()
    time.sleep(0.3)
    c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5)
    c.set("k", "v")
    assert c.get("k") == b"v"
    c.set("never", "now")
    t.join(10)
    assert not t.is_alive()
    waiter.close()
    c.close()


def _swallow(f):
    try:
        f()
    except Exception:
        pass


def test_store_servers_made_and_closed_in_a_row_all_start():
    for _ in range(150):
        s = ctrlcomm.StoreServer("127.0.0.1", 0)
        s.close()
        del s


def keys_right_after_formation(rank, size, port, api):
    """Each rank sets a key through the group's store client as soon as its group is formed
    (as vLLM code does with ``pg.store``), then reads every rank's."""
    if api == "vllm":
        g = ctrlcomm.StatelessProcessGroup.create("127.0.0.1", port, rank, size)
    else:
        g = ctrlcomm.Group.create("127.0.0.1", port, rank, size, timeout=30)
    with g:
        g.store.set(f"ready/{rank}", b"yes")
        got = [g.store.get(f"ready/{r}", timeout=10) for r in range(size)]
        g.barrier()  # (nobody closes, and so stops the store, before everyone has read)
    return got


@pytest.mark.parametrize("api", ["group", "vllm"])
@pytest.mark.parametrize("size", [2, 3])
def test_keys_set_through_the_store_right_after_formation_stay(size, api):
    # (rank 0 deleted the whole namespace once every rank had read the address table: a key
    # set by a quicker rank went with it; a few rounds, as that was a race)
    for _ in range(3):
        assert run_ranks(keys_right_after_formation, size, free_port(), api, timeout=60) \
            == [[b"yes"] * size] * size


def test_a_call_the_store_does_not_know_is_refused_at_once_not_left_to_time_out(store):
    """A client of a later version calling an op this store lacks (the queue calls, against
    a store of before them, say) hears so at once. (Before: the request was dropped as
    malformed, and the call waited out its timeout, then blamed the address or the key.)"""
    from ctrlcomm import _wire as w

    unknown = max(w.STORE_OPS) + 1
    c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=30)
    t = time.monotonic()
    with pytest.raises(ctrlcomm.StoreError, match=f"unknown store op {unknown}"):
        c._call(unknown, [b"k"], (), 30.0)
    assert time.monotonic() - t < 10.0
    c.set("still", "works")
    assert c.get("still") == b"works"
    c.close()


def test_a_group_hosting_its_store_where_another_listens_is_told_how_to_share_it():
    # as torch's new_group, which reuses its world's port: rank 0 of the second group, given
    # the port of the first one's store, binds there by default; the error says what to do
    # (before: "address already in use" alone)
    with ctrlcomm.StoreServer("127.0.0.1", 0) as srv:
        with pytest.raises(ctrlcomm.StoreError, match="address already in use.*"
                                                      "host_store=False"):
            ctrlcomm.Group.create("127.0.0.1", srv.port, 0, 2, name="sub", timeout=5)
        # and, told so, it forms through that store (a world of one: nobody else to wait for)
        with ctrlcomm.Group.create("127.0.0.1", srv.port, 0, 1, name="sub", timeout=5,
                                   host_store=False) as g:
            assert g.all_gather("x") == ["x"]
