"""Running a compiled stage in OpenVINO: stateful and paged stages, plugin settings, sampling."""
