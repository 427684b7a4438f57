"""Working with a trained team: evaluate it (pass@k), export it for other tools, watch it play one problem."""
