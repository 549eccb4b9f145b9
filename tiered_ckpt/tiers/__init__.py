"""The built-in tiers (docs/tiers.md). Importing the package registers :class:`~tiered_ckpt.tiers.s3.S3Tier` for
``s3://`` URLs with :class:`~tiered_ckpt.tiers.fsspec_tier.FsspecTier` (``FsspecTier.url_protocols``), so that any
way of building an fsspec tier on S3 gets it; s3fs itself is imported only when such a tier connects."""

from . import s3 as _s3  # noqa: F401  (registers S3Tier; see the docstring)
