"""The study loop and its storage: a study file's space, Optuna's ask and tell, the executors that evaluate points
(in the driver, on Ray), and the Optuna storages a study resumes from."""
