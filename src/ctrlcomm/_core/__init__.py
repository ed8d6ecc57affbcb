"""The core: a group's mailbox and the one execution loop both drivers run.

Theory of operation
-------------------
A group has one :class:`Core`. Every call (collective or point to point) is a generator
(:meth:`Core.collective`, :meth:`Core.send`, :meth:`Core.recv`) that does all the work and
yields only when it must wait, yielding the number of seconds it is willing to sleep. The
blocking driver (``_drivers.run_sync``) answers each yield by sleeping in the kernel; the
asyncio driver (``_aio.run_async``) by awaiting the socket's descriptor through the event
loop. Nothing else differs between the two.

Calls at once (full duplex). Any number of calls run on one group at once: point-to-point
calls of several tasks and threads, beside one collective (collectives run one at a time: an
event loop's in the order its tasks started them, ``_aio``; one of another thread is refused
while one is in progress, as the two could pair in a different order on another rank). What
keeps them apart:

- the endpoint's ``io`` (a re-entrant lock) is held by whichever call runs, and never across
  a wait: a send goes out while a receive waits;
- one call at a time *leads* (``Core._lock``): it sleeps on the endpoint and reads it, as a
  single call always did. The first to wait takes the lead where it is free, and keeps it to
  its end. Another that waits *follows*: it yields a :class:`Follower` instead of seconds,
  and its driver sleeps on an event (a thread) or a future (a task) of its own, until its
  deadline or until the leader, after each read, wakes the followers to look at the mailbox
  again. A follower that finds the lead free takes it. A call that is not the leader never
  reads while the leader sleeps on the endpoint (its wait and reads are the leader's: a
  ZeroMQ socket is not to be polled and read from two threads);
- receives of one (src, tag) stand in line (``_lines``), in the order they were called: only
  the first takes the next message, and only the first names it to the endpoint's short way;
- an awaited call left pending in an event loop closed by hand never resumes: its lead and
  its place in line are taken over (``Core.lead``, numbered; followers look at least every
  FOLLOW_LOOK_S);
- close() and abort() act at once where no leader sleeps on the endpoint (or it is an
  awaited call suspended in this thread's event loop), else the leader, woken, does it.

Reading: one path. A call waits, then drains the endpoint (every ready socket) into the
mailbox; the messages its step waits for (``Core.step``, an ``_endpoint.Expected``) an express
endpoint takes the short way in that drain, where a read begins with one (a header compared,
not decoded), and the mailbox is never involved.

Matching: collective messages are keyed by (seq, round, src) and kept until the plan asks for
them; messages of a later seq (a peer that is ahead) wait in the mailbox. Point-to-point
messages queue per (src, tag), in arrival order, which is send order per pair of ranks.

A collective message carries its op (and reduction op) and root. One whose seq is this rank's
current seq but whose op or root differ means the ranks diverged: :class:`MismatchError` at once.
Where no such message comes (every rank waits for another), the ranks a collective waits for
are asked what they are doing 1, 3, 7, 15... s into it and shortly before its deadline; an
answer names the collective the peer is in (or returned from last), and one at this seq with
another op or root raises a :class:`MismatchTimeoutError` (the call cannot complete: both a
mismatch and a timeout) when it is read, which the rank tells the others (a rank waiting in
that call raises one too, at once).

States: see ``_lifecycle``. A collective that fails leaves the seq counters of the ranks out of
step, so the group is then broken: every later call raises :class:`GroupBrokenError` naming
the first cause. A point-to-point ``recv`` that times out or is cancelled leaves the group
open (a late message is simply queued for the next ``recv``). Bad arguments are rejected
before a seq number is taken, so they leave the group open too.

The parts, one responsibility each, bottom to top (each calls only those below it):
``_state`` (what they share), ``_sending``, ``_session``, ``_mismatch``, ``_liveness``,
``_mailbox``, and ``_core`` (:class:`Core`: a call's steps, start to end).
"""

from ._common import DRIVER_CODES as DRIVER_CODES
from ._common import IO_TAKE_S as IO_TAKE_S
from ._common import MAX_PAYLOAD as MAX_PAYLOAD
from ._common import Call as Call
from ._common import Follower as Follower
from ._common import Wait as Wait
from ._common import _get_ident as _get_ident
from ._common import _monotonic as _monotonic
from ._common import flight_record_size as flight_record_size
from ._core import Core as Core
