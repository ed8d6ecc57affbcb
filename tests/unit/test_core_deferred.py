"""close() and abort() asked while the group's own thread is carrying out another: they run
one after the other, never one inside the other.

The core runs against an in-memory endpoint that records what is sent: this tests the
order of the core's steps, not communication (tests/faults does that with real ranks)."""


from ctrlcomm import _wire as w
from ctrlcomm._core import Core
from ctrlcomm.testing._standin import StandInEndpoint


class RecordingEndpoint(StandInEndpoint):
    def __init__(self, during_first_send):
        super().__init__()
        self.log = []
        self.during_first_send = during_first_send

    def send(self, dst, frames):
        if self.closed:
            raise OSError("closed")
        self.log.append((w.decode(frames, b"k" * 32, dst).kind, dst))
        hook, self.during_first_send = self.during_first_send, None
        if hook is not None:
            hook()  # (a signal handler, run in the middle of the send)

    def close(self, gone=()):
        self.log.append(("closed", None))
        self.closed = True


def test_a_close_asked_while_this_thread_sends_an_abort_of_an_idle_group_waits_for_it():
    # (before: the close ran inside the abort's sending, in a signal handler say: it closed
    # the sockets there, and the abort never reached the peers it had not reached yet)
    core = None

    def close():
        core.close()

    ep = RecordingEndpoint(close)
    core = Core(name="g", rank=0, size=3, group_id=7, endpoint=ep, codec=w.PICKLE, key=b"k" * 32,
                timeout=5.0)
    n = core.lead()  # (a call made and ended in this thread before: it led)
    assert n
    core.end_call(n)
    core.abort("watchdog")
    assert ep.log == [(w.ABORT, 1), (w.ABORT, 2), (w.BYE, 1), (w.BYE, 2), ("closed", None)]
