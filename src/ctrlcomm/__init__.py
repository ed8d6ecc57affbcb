"""ctrlcomm: the control plane of distributed ML systems.

Fast, asyncio-native, stateless groups for the small messages ranks exchange beside their
tensor traffic. Start with :meth:`Group.create`.
"""

from ._errors import CodecError as CodecError
from ._errors import CollectiveTimeoutError as CollectiveTimeoutError
from ._errors import ConcurrentUseError as ConcurrentUseError
from ._errors import CtrlcommError as CtrlcommError
from ._errors import FormationError as FormationError
from ._errors import FormationTimeoutError as FormationTimeoutError
from ._errors import GroupBrokenError as GroupBrokenError
from ._errors import GroupClosedError as GroupClosedError
from ._errors import InvalidArgumentError as InvalidArgumentError
from ._errors import MismatchError as MismatchError
from ._errors import MismatchTimeoutError as MismatchTimeoutError
from ._errors import OperandError as OperandError
from ._errors import PeerLostError as PeerLostError
from ._errors import ReductionError as ReductionError
from ._errors import StoreError as StoreError
from ._errors import StoreQueueEmptyError as StoreQueueEmptyError
from ._errors import StoreTimeoutError as StoreTimeoutError
from ._group import AioGroup as AioGroup
from ._group import Group as Group
from ._group import dump_flight_records as dump_flight_records
from ._group import dump_flight_records_on as dump_flight_records_on
from ._megatron import AsyncZMQCommunicator as AsyncZMQCommunicator
from ._vllm import StatelessProcessGroup as StatelessProcessGroup
from .rendezvous._client import StoreClient as StoreClient
from .rendezvous._server import StoreServer as StoreServer
from .rendezvous._state import StoreLimits as StoreLimits

__version__ = "0.1.0"

__all__ = [
    "AioGroup",
    "AsyncZMQCommunicator",
    "CodecError",
    "CollectiveTimeoutError",
    "ConcurrentUseError",
    "CtrlcommError",
    "FormationError",
    "FormationTimeoutError",
    "Group",
    "GroupBrokenError",
    "GroupClosedError",
    "InvalidArgumentError",
    "MismatchError",
    "MismatchTimeoutError",
    "OperandError",
    "PeerLostError",
    "ReductionError",
    "StatelessProcessGroup",
    "StoreClient",
    "StoreError",
    "StoreLimits",
    "StoreQueueEmptyError",
    "StoreServer",
    "StoreTimeoutError",
    "__version__",
    "dump_flight_records",
    "dump_flight_records_on",
]
