"""For testing code that uses dcp_volumes: an object store in this process's memory.

``MemoryStore`` serves ``dcp-memory://BUCKET/PREFIX`` URLs to every class of the
package (writer, reader, manager, dataset) in this process, and can fail, stall
or lag chosen requests (see docs/volumes.md, "Testing without a server").
"""

from dcp_volumes._volume._memory import MEMORY_PROTOCOL, FailureKind, MemoryStore, Operation, Rule

__all__ = ["MEMORY_PROTOCOL", "FailureKind", "MemoryStore", "Operation", "Rule"]
