use vpcnet_bpf_tests::{Harness, INET, POD, TC_ACT_UNSPEC, NODE, packets::{self, TCP_SYN}};

#[test]
fn pod_syn_to_internet_is_snated() {
    let h = Harness::lab_default();
    let out = h.egress(&packets::tcp(POD, 40000, INET, 80, TCP_SYN, b""));
    assert_eq!(out.action, TC_ACT_UNSPEC);
    let p = packets::parse(&out.packet);
    assert_eq!(p.src, NODE);
    assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
}
