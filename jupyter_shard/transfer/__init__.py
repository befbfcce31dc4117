"""Moving values between the driver and the ranks: tensors pickled as raw buffers (``pickling``),
shared-memory segments (``segments``), copies straight into another process's memory
(``peer_memory``) and the mappings both use (``mapping``)."""
