"""The tiny demo model, built here in well under a minute on a CPU (no model hub needed).

- `build`: the tasks' recipes and formats, the build, its checks, the cache and the CLI
  (`python -m slime_meta.models.tiny`);
- `tokenizer`: the character tokenizer and the model's shape;
- `training`: the pretraining loop and decoding.
"""
