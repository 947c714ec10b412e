"""Statistic keys of the file writers (``writer._stats``), DeepSpeed's names, and ``INVALID_FD``."""

INVALID_FD = -1  # what the writers' fileno() answers: torch must go through write(), not the raw descriptor

FILE_PATH_KEY = "path"
FLUSH_COUNT_KEY = "flush"
WRITE_COUNT_KEY = "write"
CLOSE_COUNT_KEY = "close"
FILENO_COUNT_KEY = "fileno"
WRITE_BYTES_KEY = "bytes"
WRITE_SEC_KEY = "write_secs"
WRITE_SPEED_KEY = "write_GB/s"

AIO_WRITE_SEC_KEY = "aio_write_secs"
AIO_WRITE_BYTES_KEY = "aio_bytes"
AIO_SPEED_KEY = "aio_GB/s"
SLOW_WRITE_BYTES_KEY = "slow_bytes"
SLOW_WRITE_SEC_KEY = "slow_write_secs"
AIO_FILL_BUFFER_SEC_KEY = "fill_buffer_secs"
AIO_FILL_BUFFER_COUNT_KEY = "fill_buffer_count"
AIO_FILL_BUFFER_SPEED_KEY = "fill_buffer_GB/s"

SAVE_STORAGE_KEY = "save_storage"
SAVE_STORAGE_BYTES_KEY = "save_storage_bytes"
SAVE_STORAGE_SEC_KEY = "save_storage_secs"
STORAGE_OBJ_SIZE = 8  # bytes of the int64 element count written before a storage when save_size is asked

RANK_KEY = "rank"

__all__ = [name for name in dir() if name.isupper()]
