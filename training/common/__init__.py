"""What the recipes share: data, presets, the Trainer pieces, callbacks, figures, model cards."""
