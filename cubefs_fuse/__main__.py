from cubefs_fuse.cli import main

raise SystemExit(main())
