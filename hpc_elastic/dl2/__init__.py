"""DL² (Peng et al., EuroSys'19): the torch side of the deep-RL slot scheduler.

:mod:`hpc_elastic.policy.dl2` holds the pure part (state, actions, mask, inference loop, :class:`Dl2Policy`);
this package holds the networks (:mod:`.net`), their training in the slot simulator (:mod:`.train`), the model file
(:mod:`.model_file`), a model's evaluation against the baselines (:mod:`.evaluate`) and the one Slurm adapter,
which trains on the cluster's own history (:mod:`.sacct` reads it; :mod:`.history`, pure and without torch, cuts
it into DL²'s slots). It needs torch (except :mod:`.history`).
"""
