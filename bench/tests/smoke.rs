//! A tiny `cargo xtask bench`: one short round of every measurement in
//! every datapath, through the lab, then the report and the plots. It
//! checks that the benchmark works, not what it measures.
//!
//! Needs the workspace's binaries (`cargo build --workspace --bins`).

use std::{fs, path::PathBuf};

use vpcnet_bench::{BenchOptions, Results, report, write_outputs};
use vpcnet_lab::Datapath;

fn bin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_vpcnet-loadgen"))
        .parent()
        .expect("the binaries' directory")
        .to_path_buf()
}

/// Removes the output directory when dropped.
struct OutDir(PathBuf);

impl Drop for OutDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[test]
fn smoke_run_measures_every_figure_and_writes_the_report_and_plots() {
    let opts = BenchOptions::smoke(bin_dir());
    let results =
        vpcnet_bench::run::run(&opts, &|step| println!("bench: {step}")).expect("the smoke run");
    assert!(
        !vpcnet_lab::exists().expect("lab state"),
        "the run left a lab behind"
    );

    // Every figure of the report has a value in each of its datapaths.
    for section in report::sections(&results) {
        for figure in &section.figures {
            for &datapath in section.datapaths {
                let value = figure.median(&results, datapath);
                assert!(
                    value.is_some_and(f64::is_finite),
                    "{} ({}) in {datapath}: {value:?}",
                    figure.title,
                    figure.unit
                );
            }
        }
    }
    // Traffic flowed through every datapath, and the kept connection
    // survived the churn.
    for datapath in [Datapath::Routed, Datapath::Iptables, Datapath::Ebpf] {
        for name in ["snat_rr", "pod_rr", "eni_rr", "snat_crr"] {
            let rate = results.median(datapath, name, "rate").unwrap_or(0.0);
            assert!(rate > 0.0, "{name} in {datapath}: rate {rate}");
            assert_eq!(
                results.median(datapath, name, "failures"),
                Some(0.0),
                "{name} in {datapath}"
            );
        }
        let gbps = results
            .median(datapath, "snat_stream", "gbps")
            .unwrap_or(0.0);
        assert!(gbps > 0.0, "snat_stream in {datapath}: {gbps}");
    }
    for datapath in [Datapath::Iptables, Datapath::Ebpf] {
        assert_eq!(
            results.median(datapath, "nat_churn", "kept_flow_failures"),
            Some(0.0)
        );
        assert!(
            results
                .median(datapath, "nat_churn", "opened")
                .unwrap_or(0.0)
                > 0.0
        );
    }
    assert_eq!(
        results.median(Datapath::Ebpf, "cni_add", "calls"),
        Some(f64::from(
            u32::try_from(opts.cni_pods * opts.cni_cycles).expect("a few")
        ))
    );
    let targets = report::targets(&results);
    assert!(
        targets.len() >= 5 && targets.iter().all(|t| t.met.is_some()),
        "{targets:?}"
    );

    let out =
        OutDir(std::env::temp_dir().join(format!("vpcnet-bench-smoke-{}", std::process::id())));
    let written = write_outputs(&results, &out.0).expect("writing the outputs");
    let json = fs::read_to_string(out.0.join("results.json")).expect("results.json");
    let back: Results = serde_json::from_str(&json).expect("results.json parses");
    assert_eq!(back.measurements.len(), results.measurements.len());
    let md = fs::read_to_string(out.0.join("report.md")).expect("report.md");
    assert!(
        md.contains("| SNAT (pod → inet) CRR, server closes | conn/s |"),
        "{md}"
    );
    for plot in [
        "latency_snat_rr.svg",
        "scale.svg",
        "nat_churn.svg",
        "cni.svg",
    ] {
        let svg = fs::read_to_string(out.0.join(plot)).unwrap_or_else(|e| panic!("{plot}: {e}"));
        assert!(
            svg.starts_with("<svg") && svg.contains("<polyline"),
            "{plot} is no line plot"
        );
    }
    println!("{md}");
    println!("wrote {written:?}");
}
