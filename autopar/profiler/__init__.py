"""Stage 2: symbolic FLOPs and bytes per node (`profile`) and a training-step memory model (`peak_memory`)."""
from autopar.profiler.memory import MemoryEstimate, block_call_of, block_of, peak_memory, storage_facts
from autopar.profiler.profile import ProfileError, profile
from autopar.profiler.table import ProfileRow, profile_table

__all__ = ["profile", "ProfileError", "peak_memory", "storage_facts", "MemoryEstimate", "block_of", "block_call_of", "profile_table", "ProfileRow"]
