"""The Python client of mqds.

>>> from mqds.client import Client, Message
>>> c = Client(["127.0.0.1:7101"])                       # doctest: +SKIP
>>> c.store_batch([Message(topic="t/1", payload=b"x", sender="pub-1", qos=1)])  # doctest: +SKIP
"""

from mqds.client import errors
from mqds.client.client import Client
from mqds.client.model import Generation, Iterator, Message, NextResult, Rank, Stream

__all__ = ["Client", "Generation", "Iterator", "Message", "NextResult", "Rank", "Stream", "errors"]
