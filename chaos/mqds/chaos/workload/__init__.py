"""The workload of a chaos run: exactly-once publishers, readers, push subscribers, persistent-session consumers.

Every worker is a thread with its own :class:`~mqds.client.Client`, and
records what it did and saw in the run's :class:`~mqds.chaos.history.History`:

- :mod:`~mqds.chaos.workload.publisher`: the publishers (:class:`Publisher`),
  exactly-once writes retried under the same client sequence, and
  :func:`senders_for_shards`;
- :mod:`~mqds.chaos.workload.pipelined`: :class:`PipelinedPublisher`, one
  message per ``store_async`` call with many in flight, as a broker stores;
- :mod:`~mqds.chaos.workload.reader`: the readers (:class:`Reader`), tailing
  ``chaos/#`` with iterators and checking what they see as they go;
- :mod:`~mqds.chaos.workload.follower`: the push subscribers
  (:class:`Follower`), following ``chaos/#`` with ``Client.follow`` through
  every fault: each must be sent every acknowledged message exactly once;
- :mod:`~mqds.chaos.workload.consumer`: the persistent-session consumers'
  shared loop (fetch, record, acknowledge) and :class:`SessionConsumer`, what
  the runner needs of one; :mod:`~mqds.chaos.workload.pubsub_consumer`
  (:class:`PubsubConsumer`, ``chaos-sub-<n>``: its own read position on
  ``chaos/#``, must get every message) and
  :mod:`~mqds.chaos.workload.queue_consumer` (:class:`QueueConsumer`,
  ``chaos-queue-<n>``: queue mode shared on the topics of a slow publisher of
  their own, sender :data:`QUEUE_SENDER`; between them they must get every
  message of it);
- :mod:`~mqds.chaos.workload.pause`: pausing the writers (:class:`PauseGate`,
  :class:`WorkloadPause`) for the idle spells of the ``idle-restart``
  nemeses.
"""

from mqds.chaos.workload.consumer import SessionConsumer
from mqds.chaos.workload.follower import Follower
from mqds.chaos.workload.pause import PauseGate, WorkloadPause
from mqds.chaos.workload.pipelined import PipelinedPublisher
from mqds.chaos.workload.publisher import Publisher, PublisherThread, senders_for_shards
from mqds.chaos.workload.pubsub_consumer import PubsubConsumer
from mqds.chaos.workload.queue_consumer import QUEUE_BATCH, QUEUE_INTERVAL_S, QUEUE_SENDER, QueueConsumer
from mqds.chaos.workload.reader import Reader

__all__ = [
    "QUEUE_BATCH",
    "QUEUE_INTERVAL_S",
    "QUEUE_SENDER",
    "Follower",
    "PauseGate",
    "PipelinedPublisher",
    "Publisher",
    "PublisherThread",
    "PubsubConsumer",
    "QueueConsumer",
    "Reader",
    "SessionConsumer",
    "WorkloadPause",
    "senders_for_shards",
]
