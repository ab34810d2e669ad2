"""Data pipeline: corpus readers, a byte-level tokenizer, document packing, Grain batches.

`load_datasets(seq_len=1024)` reads the Python standard library that ships with the
interpreter (nothing to download), holds out whole documents for validation and packs
both splits into rows whose `Batch`es carry segment ids and per-document positions.
`GrainBatches` / `GrainEvalBatches` serve them through Grain, each process feeding only
the rows and sequence slots its devices hold; `place_batch` is the one placement of a host
batch on the mesh (any process count), `place_local` of a process's own block.
"""

from ._corpus import load_corpus as load_corpus
from ._corpus import load_datasets as load_datasets
from ._corpus import split_documents as split_documents
from ._grain import GrainBatches as GrainBatches
from ._grain import GrainEvalBatches as GrainEvalBatches
from ._grain_rows import EpochShuffle as EpochShuffle
from ._grain_rows import PackDocuments as PackDocuments
from ._hf_tokenizer import TOKENIZER_FILES as TOKENIZER_FILES
from ._hf_tokenizer import HFTokenizer as HFTokenizer
from ._packing import Batch as Batch
from ._packing import PackedDataset as PackedDataset
from ._packing import Tokenizer as Tokenizer
from ._packing import pack_documents as pack_documents
from ._place import ProcessSlice as ProcessSlice
from ._place import place_batch as place_batch
from ._place import place_local as place_local
from ._place import process_slice as process_slice
from ._tokenizer import ByteTokenizer as ByteTokenizer
