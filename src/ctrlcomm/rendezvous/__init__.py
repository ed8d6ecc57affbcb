"""Rendezvous: how the ranks of a group find each other, and nothing else.

The store only forms groups (ranks publish their endpoints, rank 0 publishes the table and the
group's secret); it is never the data plane.

- ``_state``: :class:`StoreState`, the store's logic with no sockets and no clock of its own
  (callers pass ``now``), its access rules and :class:`StoreLimits`.
- ``_server``: :class:`StoreServer`, which runs a state on a socket in a daemon thread
  (plain TCP without a key; ZeroMQ with CurveZMQ with one).
- ``_conn``: the client's connections to a server (``StoreStream``, ``StoreConnection``), with
  request ids so a late reply to a timed-out request is recognised and dropped.
- ``_client``: :class:`StoreClient`, the store's API.
- ``_formation``: the formation protocol a group runs through a store.
"""

from ._client import StoreClient as StoreClient
from ._server import StoreServer as StoreServer
from ._state import StoreLimits as StoreLimits
from ._state import StoreState as StoreState
