"""The model lifecycle: the repository on disk (`repository`), what each kind is (`kinds`), loading and warm-up
(`registry`, `warmup`) and control while serving (`control`)."""
