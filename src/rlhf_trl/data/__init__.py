"""The one data formatter shared by SFT, reward-model and PPO stages (errors name the file, the row and the field:
`DataError`), in three steps:
1. **read** (`.read`) local files (also compressed), globs, shard directories or a hub dataset, in Arrow batches;
2. **records** (`.records`) from each row, whatever its format (`FORMATS`, `.formats`; turns: `.turns`): SFT
   ``{"question", "history", "answer"}``, pairs ``{..., "chosen", "rejected"}``, prompts ``{"question", "history"}``
   (+ ``"columns"``, ``"system"``, ``"text"``, ``"messages"`` / ``"tools"`` where the row has them); bad rows follow
   ``on_bad_row``, every skip counted in a `DataReport` (`.report`);
3. **tokenize** (`.tokenize`): ``prompt_ids + response_ids + [eos]``, each part tokenized on its own as PPO joins
   prompt and generated ids, so the reward model scores the ids it was trained on (no tokens merged across ``"答："``);
   the text rendered by a `Template` (`.template`). The recipe's fields: `DataArguments` (`.args`)."""

from .args import FORMATS, DataArguments
from .read import describe_sources, load_rows, sources
from .records import pair_records, prompt_records, read_records, sft_records, split_records, unpaired_records
from .report import DataError, DataReport
from .template import DEFAULT_PROMPT_TEMPLATE, Template
from .tokenize import (chat_end_of_turn_id, encode_prompt, encode_response, pair_features, prompt_features,
                       response_eos_id, sft_features, unpaired_features)
from .turns import split_transcript

__all__ = ["DEFAULT_PROMPT_TEMPLATE", "FORMATS", "DataArguments", "DataError", "DataReport", "Template",
           "chat_end_of_turn_id", "describe_sources", "encode_prompt", "encode_response", "load_rows", "pair_features",
           "pair_records", "prompt_features", "prompt_records", "read_records", "response_eos_id", "sft_features",
           "sft_records", "sources", "split_records", "split_transcript", "unpaired_features", "unpaired_records"]
