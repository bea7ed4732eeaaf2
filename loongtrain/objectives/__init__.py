"""What a run trains (docs/design.md#how-to-add-an-objective): one module per objective (pretraining, SFT, DPO),
the router's load-balancing term any objective adds, and the registry the launcher, the commands and the planner's
command ask (registry.py). One floor above ``train/``: the trainer receives the objective through
:class:`loongtrain.train.objective.ObjectiveRecipe`."""
