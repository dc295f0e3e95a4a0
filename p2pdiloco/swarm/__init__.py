"""Swarm-facing modules: the only code that imports hivemind.

How tensors are shared between a peer and its helper processes is chosen here, once, for every module below.
hivemind's import sets torch's sharing strategy from HIVEMIND_MEMORY_SHARING_STRATEGY, `file_system` unless it
is set: right for its expert servers, which pass thousands of tensors through queues, where one descriptor per
tensor would run out. A peer shares a handful (the averaging buffer, a served snapshot's two vectors,
hivemind's futures' state), and `file_system` costs it a torch_shm_manager process per peer and files in
/dev/shm that a SIGKILLed peer leaks until reboot (runtime.lifeline cleans up after the peers it watches).
`file_descriptor` unlinks each segment as soon as it is mapped and needs no manager. (The manager's 70 MB of
PSS are mostly pages it shares with the peer: the peak did not measurably drop without it, docs/hardware.md.)
The same environment variable still decides where it is set."""
import os

import hivemind
import torch.multiprocessing

HIVEMIND_VERSION = hivemind.__version__  # its import set torch's strategy, which we replace just below
SHARING_STRATEGY = os.environ.get("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
torch.multiprocessing.set_sharing_strategy(SHARING_STRATEGY)
