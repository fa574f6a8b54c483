"""The remote fixtures (emulated gs:// and s3://) for hostile remote tests."""

from remote.conftest import gcs  # noqa: F401  # pylint: disable=unused-import
from remote.conftest import remote  # noqa: F401  # pylint: disable=unused-import
from remote.conftest import s3  # noqa: F401  # pylint: disable=unused-import
from remote.conftest import store  # noqa: F401  # pylint: disable=unused-import
