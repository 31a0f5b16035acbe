"""One design point: read and checked (point files, feasibility), evaluated through the plugins, exported
(Chakra traces, Perfetto timelines, summaries), and the model calibrated against measured points."""
