"""The procedures over the model's files: post-hoc EMA (posthoc; anyema for any model), generation (with
the release's presets_generate), image batches for statistics and image grids."""
