"""URL manifests (one file, or a folder or pattern of files) read as a stream and cut into download chunks, memory bounded whatever their size.

The parts: ``files`` (one file: its record, its errors, its bytes opened hashed), ``sources``
(where a source's files are, listed), ``careful`` (the row-at-a-time reader and its caps),
``text`` (csv / tsv through pyarrow's parser), ``values`` (URL verdicts, wrong types, extras),
``jsonl`` (json lines by blocks), ``reading`` (a file into judged batches), ``chunks`` (the
chunk schema, row ids and keys, content hashes) and ``planning`` (per-file plans and their
combination).
"""

from tasks.formats.manifests.careful import MAX_ROW_BYTES
from tasks.formats.manifests.chunks import (
    CHUNK_SCHEMA,
    MAX_FILE_ROWS,
    PARSE_VERSION,
    ChunkRef,
    chunk_name,
    read_chunk,
    sample_key,
)
from tasks.formats.manifests.files import ManifestError, ManifestFile
from tasks.formats.manifests.planning import (
    FilePlan,
    SourcePlan,
    combine,
    group_files,
    iter_chunks,
    plan_file,
    plan_files,
    plan_source,
)
from tasks.formats.manifests.sources import list_manifest_files
from tasks.formats.manifests.values import URL_SCHEMES, url_problem, url_reason

__all__ = [
    "CHUNK_SCHEMA",
    "MAX_FILE_ROWS",
    "MAX_ROW_BYTES",
    "PARSE_VERSION",
    "URL_SCHEMES",
    "ChunkRef",
    "chunk_name",
    "FilePlan",
    "ManifestError",
    "ManifestFile",
    "SourcePlan",
    "combine",
    "group_files",
    "iter_chunks",
    "list_manifest_files",
    "plan_file",
    "plan_files",
    "plan_source",
    "read_chunk",
    "sample_key",
    "url_problem",
    "url_reason",
]
