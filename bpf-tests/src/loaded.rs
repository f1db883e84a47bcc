//! Programs loaded once per test process: loading the four programs costs
//! seconds under a VM's TCG, paid again by every verdict test. A harness
//! hands its programs back when its test passed; the next one takes them
//! with every map emptied, as a fresh load has them. Their pins are removed
//! at load (the maps live on in the programs' descriptors), so nothing is
//! left behind when the process ends.

use std::sync::Mutex;

use aya::maps::{HashMap, MapData, PerCpuValues};
use vpcnet_agent::datapath::{Datapath, DatapathError, LoadOptions, pins, remove_pins};
use vpcnet_common::{
    config::Config,
    counters::COUNTER_SLOTS,
    maps as names,
    nat::{FragKey, FragPath, Timeouts},
};

/// What goes with loaded programs: their NAT size, and the one pinned map
/// the agent keeps no handle on.
pub struct Loaded {
    nat_entries: u32,
    frag_paths: HashMap<MapData, FragKey, FragPath>,
}

static LOADED: Mutex<Vec<(Loaded, Datapath)>> = Mutex::new(Vec::new());

/// Empties every map's entries (`ClearMap` needs keys it can list).
macro_rules! clear {
    ($map:expr) => {{
        let keys: Vec<_> = $map
            .keys()
            .collect::<Result<_, _>>()
            .expect("listing a map's keys");
        for key in keys {
            $map.remove(&key).expect("removing a map entry");
        }
    }};
}

/// The fragment paths map of `datapath`, opened from its pin (the agent's
/// typed maps leave it out).
///
/// # Errors
/// The pin cannot be opened as that map.
pub fn frag_paths(
    datapath: &Datapath,
) -> Result<HashMap<MapData, FragKey, FragPath>, DatapathError> {
    let pinned = names::ALL
        .into_iter()
        .find(|m| m.name == names::FRAG_PATHS)
        .ok_or(DatapathError::MissingMap(names::FRAG_PATHS))?;
    let path = pins::pin_path(datapath.pin_dir(), &pinned);
    let data = MapData::from_pin(&path).map_err(|source| DatapathError::OpenPinned {
        path: path.clone(),
        source,
    })?;
    HashMap::try_from(aya::maps::Map::LruHashMap(data)).map_err(|source| DatapathError::Map {
        name: names::FRAG_PATHS,
        source,
    })
}

impl Loaded {
    /// Programs with `nat_entries` flows per NAT map: the ones a passed
    /// test handed back, emptied, else a fresh load.
    ///
    /// # Errors
    /// Loading fails.
    pub fn take(nat_entries: u32) -> Result<(Self, Datapath), DatapathError> {
        let kept = {
            let mut all = LOADED
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            all.iter()
                .position(|(l, _)| l.nat_entries == nat_entries)
                .map(|i| all.swap_remove(i))
        };
        match kept {
            Some((mut loaded, mut datapath)) => {
                loaded.empty(&mut datapath);
                Ok((loaded, datapath))
            }
            None => Self::load(nat_entries),
        }
    }

    fn load(nat_entries: u32) -> Result<(Self, Datapath), DatapathError> {
        let pin_dir = super::Harness::new_pin_dir();
        let loaded = Datapath::load(&LoadOptions {
            pin_dir: pin_dir.clone(),
            nat_entries,
            ..LoadOptions::default()
        })
        .and_then(|datapath| {
            let frag_paths = frag_paths(&datapath)?;
            Ok((
                Self {
                    nat_entries,
                    frag_paths,
                },
                datapath,
            ))
        });
        let _ = remove_pins(&pin_dir);
        loaded
    }

    /// Hands the programs back for the next harness of this process,
    /// unless a reader took their event ring.
    pub fn give_back(self, datapath: Datapath) {
        if datapath.policy_events_taken() {
            return;
        }
        LOADED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((self, datapath));
    }

    /// Every map as a fresh load has it.
    fn empty(&mut self, datapath: &mut Datapath) {
        let maps = &mut datapath.maps;
        maps.set_config(&Config::default()).expect("the config");
        maps.ct_timeouts
            .set(0, Timeouts::default(), 0)
            .expect("the timeouts");
        clear!(maps.cidrs);
        clear!(maps.nat_fwd);
        clear!(maps.nat_rev);
        clear!(maps.endpoints);
        clear!(maps.enis);
        clear!(maps.stack_flows);
        clear!(maps.external_service_cidrs);
        clear!(maps.policy_pods);
        clear!(maps.policy_cidrs);
        clear!(maps.policy_ports);
        clear!(maps.policy_flows);
        clear!(maps.policy_verdicts);
        clear!(self.frag_paths);
        let cpus = aya::util::nr_cpus().expect("the possible CPUs");
        for slot in 0..COUNTER_SLOTS {
            let zeros = PerCpuValues::try_from(vec![0u64; cpus]).expect("per-CPU zeros");
            maps.counters.set(slot, zeros, 0).expect("a counter");
        }
    }
}
