"""The engine: slot KV cache, jitted prefill/decode steps, on-device sampling, continuous batching.

``Engine(model)`` runs sequences in slots (engine.py); ``Scheduler(engine)`` turns requests into
event streams (scheduler.py); ``SamplingParams`` and ``StopConditions`` describe a request.
"""

from .engine import Engine, Sampled, Sequence
from .sampling import SamplingParams
from .scheduler import Event, QueueFullError, Request, Scheduler
from .stops import StopConditions

__all__ = ["Engine", "Sampled", "Sequence", "SamplingParams", "Event", "QueueFullError", "Request", "Scheduler",
           "StopConditions"]
