"""Groups made from a group (split, new_group), shrunk to the survivors of a kill -9, grown
back with new processes (Group.join), and a rank that comes after formation: real processes
over real sockets."""

import asyncio
import os
import signal
import threading
import time

import pytest

import ctrlcomm
from ctrlcomm.testing import free_port, kill_ranks, run_ranks


def _create(rank, size, port, name, **kw):
    kw.setdefault("timeout", 30)
    return ctrlcomm.Group.create("127.0.0.1", port, rank, size, name=name, **kw)


# ---------------------------------------------------------------------------- split


def splits(rank, size, port, transport, ncolors):
    with _create(rank, size, port, "split", transport=transport) as g:
        color = None if rank == size - 1 and size > 2 else rank % ncolors
        sub = g.split(color, key=-rank)  # (ranked by key: the highest rank first)
        if sub is None:
            g.barrier()  # (the parent still works, in step with the members)
            return None
        with sub:
            got = (sub.rank, sub.world_size, sub.parent_ranks, sub.name,
                   sub.all_gather(rank), sub.all_reduce(rank), sub.broadcast(f"from {rank}"))
            if sub.world_size > 1:  # point to point in the new group
                sub.send(rank, (sub.rank + 1) % sub.world_size)
                got += (sub.recv((sub.rank - 1) % sub.world_size),)
        g.barrier()
        return got


@pytest.mark.parametrize(("size", "ncolors"), [(2, 1), (4, 2), (6, 3)])
def test_split_forms_a_group_per_color_ranked_by_key(size, ncolors):
    res = run_ranks(splits, size, free_port(), None, ncolors)
    for rank, out in enumerate(res):
        if rank == size - 1 and size > 2:
            assert out is None
            continue
        color = rank % ncolors
        members = sorted((r for r in range(size) if r % ncolors == color
                          and not (r == size - 1 and size > 2)), reverse=True)
        n = len(members)
        me = members.index(rank)
        assert out[:4] == (me, n, members, f"split.{color}"), out
        assert out[4] == members and out[5] == sum(members), out
        assert out[6] == f"from {members[0]}"
        if n > 1:
            assert out[7] == members[(me - 1) % n]


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_split_over_each_transport(transport):
    res = run_ranks(splits, 4, free_port(), transport, 2)
    assert [r[2] for r in res[:3]] == [[2, 0], [1], [2, 0]] and res[3] is None
    assert res[0][4] == [2, 0] and res[1][4] == [1]


def nested(rank, size, port):
    with _create(rank, size, port, "nest") as g:
        a = g.split(rank // 2, name="half")
        b = a.split(0, key=rank)  # (a split of a split)
        out = b.all_gather(rank), b.parent_ranks, a.parent_ranks
        b.close()
        a.close()
        return out


def test_a_split_of_a_split():
    res = run_ranks(nested, 4, free_port())
    assert res[0] == ([0, 1], [0, 1], [0, 1])
    assert res[3] == ([2, 3], [0, 1], [2, 3])


def split_awaited(rank, size, port):
    async def main(g):
        sub = await g.aio.split(rank % 2)
        ng = await g.aio.new_group([0, 3])
        out = (await sub.aio.all_gather(rank),
               None if ng is None else await ng.aio.all_reduce(rank))
        sub.close()
        if ng is not None:
            ng.close()
        return out

    with _create(rank, size, port, "asplit") as g:
        return asyncio.run(main(g))


def test_split_and_new_group_awaited():
    res = run_ranks(split_awaited, 4, free_port())
    assert res == [([0, 2], 3), ([1, 3], None), ([0, 2], None), ([1, 3], 3)]


def split_bad(rank, size, port):
    with _create(rank, size, port, "sbad") as g:
        errors = []
        for args in [("red",), (1.5,), (0, "k")]:
            try:
                g.split(*args)
            except ctrlcomm.InvalidArgumentError as e:
                errors.append(str(e))
        try:
            g.split(0, name="a/b")
        except ctrlcomm.InvalidArgumentError as e:
            errors.append(str(e))
        try:  # (names differ between the ranks of a color: every member is told)
            g.split(0, name=f"n{rank}")
        except ctrlcomm.InvalidArgumentError as e:
            errors.append(str(e))
        return errors, g.all_reduce(1)


def test_split_refuses_bad_arguments_and_the_group_goes_on():
    for errors, total in run_ranks(split_bad, 3, free_port()):
        assert total == 3
        assert len(errors) == 5, errors
        assert "color must be an int" in errors[0] and "color must be an int" in errors[1]
        assert "key must be an int" in errors[2]
        assert "group name" in errors[3]
        assert "different names" in errors[4]


# ---------------------------------------------------------------------------- new_group


def new_groups(rank, size, port, ranks):
    with _create(rank, size, port, "ng") as g:
        ng = g.new_group(ranks)
        out = None if ng is None else (ng.rank, ng.world_size, ng.parent_ranks,
                                       ng.all_gather(rank))
        bad = []
        for wrong in ([], [0, 0], [size], "01", [0, 1.5]):
            try:
                g.new_group(wrong)
            except ctrlcomm.InvalidArgumentError as e:
                bad.append(str(e))
        try:  # (the ranks give different lists: each is told, and the group goes on)
            g.new_group([0, 1] if rank == 0 else [0])
        except ctrlcomm.InvalidArgumentError as e:
            bad.append(str(e))
        total = g.all_reduce(1)
        if ng is not None:
            ng.close()
        return out, bad, total


@pytest.mark.parametrize(("size", "ranks"), [(3, [2, 0]), (5, [4, 1, 3])])
def test_new_group_has_the_ranks_given_in_their_order(size, ranks):
    members = sorted(ranks)
    for rank, (out, bad, total) in enumerate(run_ranks(new_groups, size, free_port(), ranks)):
        assert total == size
        assert len(bad) == 6, bad
        assert "different ranks" in bad[-1]
        if rank in members:
            assert out == (members.index(rank), len(members), members, members)
        else:
            assert out is None


def test_reserved_tags_are_refused():
    res = run_ranks(reserved, 2, free_port())
    assert all("reserved" in r for r in res)


def reserved(rank, size, port):
    with _create(rank, size, port, "tags") as g:
        try:
            g.send(1, 1 - rank, tag=-(1 << 63))
        except ctrlcomm.InvalidArgumentError as e:
            return str(e)
        return "sent"


# ------------------------------------------------------------------------------- shrink


def shrinks(rank, size, port, victims, awaited):
    g = _create(rank, size, port, "shrink", liveness_timeout=2.0)
    lost = kill_ranks(g, victims)
    s = asyncio.run(g.aio.shrink()) if awaited else g.shrink()
    out = (lost, s.rank, s.world_size, s.parent_ranks, s.all_gather(rank), s.all_reduce(1))
    s.close()
    g.close()
    return out


@pytest.mark.parametrize(("size", "victims", "awaited"), [
    (5, (2,), False),  # a middle rank
    (4, (0,), False),  # rank 0, which hosts the store
    (5, (0, 3), True),
])
def test_shrink_after_a_kill_gives_every_survivor_the_same_group(size, victims, awaited):
    res = run_ranks(shrinks, size, free_port(), victims, awaited, may_die=victims)
    alive = [r for r in range(size) if r not in victims]
    for rank in alive:
        lost, new_rank, new_size, parents, gathered, total = res[rank]
        assert set(lost) <= set(victims) and lost
        assert (new_rank, new_size) == (alive.index(rank), len(alive))
        assert parents == alive and gathered == alive and total == len(alive)


def shrinks_and_closes(rank, size, port, victims):
    g = _create(rank, size, port, "closes", liveness_timeout=2.0)
    kill_ranks(g, victims)
    t = time.monotonic()
    s = g.shrink()
    took = time.monotonic() - t
    g.close()  # (at once: a survivor still in its shrink must not take it for lost)
    with s:
        return s.parent_ranks, s.all_reduce(1), took


@pytest.mark.parametrize(("size", "victims"), [(3, (1,)), (3, (2,)), (4, (2,))])
def test_survivors_that_close_the_parent_at_once_share_one_group(size, victims):
    res = run_ranks(shrinks_and_closes, size, free_port(), victims, may_die=victims)
    alive = [r for r in range(size) if r not in victims]
    for rank in alive:
        parents, total, took = res[rank]
        assert (parents, total) == (alive, len(alive))
        # (each sees the killed process exit on this host: not after a grace for the word
        # another rank told of it, which a shrink forgets)
        assert took < 1.0, took


def aborts_then_shrinks(rank, size, port):
    with _create(rank, size, port, "abort") as g:
        try:  # (the abort may reach a rank still in the first barrier: it returns at once
            # on rank 1 once its part is in)
            g.barrier()
            if rank == 1:
                g.abort("going on without a collective")  # (alive: it is in the shrink)
            g.barrier()
        except ctrlcomm.CtrlcommError:
            pass
        with g.shrink() as s:
            return s.parent_ranks, s.all_reduce(1)


def test_a_rank_that_aborted_is_alive_and_in_the_shrunk_group():
    assert run_ranks(aborts_then_shrinks, 3, free_port()) == [([0, 1, 2], 3)] * 3


def shrinks_whole(rank, size, port):
    with _create(rank, size, port, "whole") as g:
        s = g.shrink()  # (nobody lost: the same ranks, in a new group)
        out = s.parent_ranks, s.all_gather(rank), g.all_gather(rank)
        s.close()
        return out


def test_shrink_of_a_working_group_keeps_every_rank():
    res = run_ranks(shrinks_whole, 3, free_port())
    assert res == [([0, 1, 2], [0, 1, 2], [0, 1, 2])] * 3


def dies_during_shrink(rank, size, port, victim, delay):
    g = _create(rank, size, port, "during", liveness_timeout=2.0)
    kill_ranks(g, (size - 1,))
    if rank == victim:  # killed as the shrink runs (it takes a few ms), at some point of it
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    s = g.shrink()
    chain = [s.parent_ranks]
    while True:  # a member lost since: shrink again (every survivor sees it in the all_gather)
        try:
            got = s.all_gather(chain)
            break
        except ctrlcomm.PeerLostError:
            s = s.shrink()
            chain.append(s.parent_ranks)
    return chain, got


@pytest.mark.parametrize(("victim", "delay"), [(0, 0.0), (0, 0.002), (0, 0.004),
                                              (1, 0.002), (2, 0.001), (0, 0.008)])
def test_survivors_agree_where_a_rank_dies_during_the_shrink(victim, delay):
    size = 5
    res = run_ranks(dies_during_shrink, size, free_port(), victim, delay,
                    may_die=(victim, size - 1))
    outs = [res[r] for r in range(size) if r not in (victim, size - 1)]
    chains = [c for c, _ in outs]
    assert all(c == chains[0] for c in chains), chains  # the same groups, in the same steps
    for _, got in outs:
        assert all(c == chains[0] for c in got)
    # the last group has the survivors only, as numbered in the first
    first, *rest = chains[0]
    members = first
    for step in rest:
        members = [members[i] for i in step]
    assert members == [r for r in range(size) if r not in (victim, size - 1)]


def shrink16(rank, size, port):
    g = _create(rank, size, port, "w16", liveness_timeout=5.0)
    kill_ranks(g, (7,))
    s = g.shrink()
    return s.parent_ranks, s.all_reduce(rank)


def test_shrink_at_world_16():
    res = run_ranks(shrink16, 16, free_port(), may_die=(7,), timeout=120)
    alive = [r for r in range(16) if r != 7]
    assert all(res[r] == (alive, sum(alive)) for r in alive)


# --------------------------------------------------------------------------------- grow


def grows(rank, size, port, victim, joiners):
    size -= joiners  # (the last ranks are new processes)
    if rank >= size:
        time.sleep(0.2 * (rank - size))
        g = ctrlcomm.Group.join("127.0.0.1", port, "grow", timeout=30, liveness_timeout=1.0)
        with g:
            time.sleep(2.5)  # (past the liveness timeout: every rank's heartbeats count)
            return "new", g.rank, g.world_size, g.parent_ranks, g.all_gather(rank)
    g = _create(rank, size, port, "grow", liveness_timeout=1.0)
    kill_ranks(g, (victim,))
    s = g.shrink()
    with s.grow(size) as big:
        time.sleep(2.5)
        return "old", big.rank, big.world_size, big.parent_ranks, big.all_gather(rank)


@pytest.mark.parametrize("victim", [2, 0])
def test_grow_back_to_the_old_size_after_a_kill(victim):
    size = 4
    res = run_ranks(grows, size + 1, free_port(), victim, 1, may_die=(victim,))
    alive = [r for r in range(size) if r != victim]
    everyone = [*alive, size]  # (the new process, numbered last)
    for r in [*alive, size]:
        kind, new_rank, new_size, parents, gathered = res[r]
        assert kind == ("new" if r == size else "old")
        assert new_rank == everyone.index(r) and new_size == size
        assert parents == [0, 1, 2, None] and gathered == everyone


def grows_twice(rank, size, port):
    if rank >= 2:  # two new processes for one place, both there before the grow
        try:
            with ctrlcomm.Group.join("127.0.0.1", port, "full", timeout=10) as g:
                return g.rank, g.all_gather(rank)
        except ctrlcomm.FormationError as e:
            return str(e)
    with _create(rank, 2, port, "full") as g:
        try:
            g.grow(4 if rank == 0 else 3)  # the ranks disagree: each is told
        except ctrlcomm.InvalidArgumentError as e:
            said = str(e)
        time.sleep(1.0)
        with g.grow(3) as big:
            out = big.all_gather(rank)
        return said, out


def test_grow_refuses_different_sizes_and_a_process_too_many():
    res = run_ranks(grows_twice, 4, free_port())
    joined = [r for r in (2, 3) if isinstance(res[r], tuple)]  # (the one that came first)
    assert len(joined) == 1, res
    assert "different world sizes" in res[0][0] and res[0][1] == [0, 1, joined[0]]
    assert res[1][1] == [0, 1, joined[0]]
    assert res[joined[0]] == (2, [0, 1, joined[0]])
    other = 5 - joined[0]
    assert "too many" in res[other], res[other]


# ----------------------------------------------------------------------- after formation


def comes_late(rank, size, port, late_rank):
    if rank == size - 1:  # a second process of late_rank, after formation
        time.sleep(1.0)
        t = time.monotonic()
        try:
            _create(late_rank, size - 1, port, "late", timeout=60)
        except ctrlcomm.FormationError as e:
            return str(e), time.monotonic() - t
        return "formed"
    with _create(rank, size - 1, port, "late") as g:
        g.barrier()
        g.barrier(timeout=30)  # (the late one is told meanwhile)
        time.sleep(2.5)
        return os.getpid()


@pytest.mark.parametrize("late_rank", [1, 0])
def test_a_late_process_is_told_the_group_formed_without_it(late_rank):
    res = run_ranks(comes_late, 4, free_port(), late_rank)
    text, took = res[3]
    assert "formed without this process" in text, text
    assert f"by process {res[late_rank]} of this host" in text, text
    assert took < 5, took  # (its timeout: 60 s)


def forms_again(rank, size, port):
    for _ in range(3):  # the same name, formed again after close: not "late"
        with _create(rank, size, port, "again") as g:
            total = g.all_reduce(1)
    return total


def test_the_same_name_forms_again_after_close():
    assert run_ranks(forms_again, 3, free_port()) == [3, 3, 3]
